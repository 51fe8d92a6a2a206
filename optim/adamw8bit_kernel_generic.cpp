#define OPTSTATE_ISA generic
#include "adamw8bit_kernel_impl.inc"
