#define OPTSTATE_ISA avx2
#include "adamw_kernel_impl.inc"
