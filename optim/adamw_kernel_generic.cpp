#define OPTSTATE_ISA generic
#include "adamw_kernel_impl.inc"
