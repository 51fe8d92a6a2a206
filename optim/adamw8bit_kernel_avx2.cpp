#define OPTSTATE_ISA avx2
#include "adamw8bit_kernel_impl.inc"
