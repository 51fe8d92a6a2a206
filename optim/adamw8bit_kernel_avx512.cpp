#define OPTSTATE_ISA avx512
#include "adamw8bit_kernel_impl.inc"
