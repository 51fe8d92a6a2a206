// The CUDA implementations of the optstate.fused_adamw_ and optstate.adamw8bit_ ops (cuda_step.h),
// both overloads of each (op_overloads.h). Built into the ops library only where LibTorch has CUDA.
#include <torch/library.h>

#include "cuda_step.h"
#include "op_overloads.h"

TORCH_LIBRARY_IMPL(optstate, CUDA, m) {
  using namespace optstate::optim;
  m.impl("fused_adamw_", fused_adamw_float_lr<&fused_adamw_cuda>);
  m.impl("fused_adamw_.tensor_lr", fused_adamw_tensor_lr<&fused_adamw_cuda>);
  m.impl("adamw8bit_", adamw8bit_float_lr<&adamw8bit_cuda>);
  m.impl("adamw8bit_.tensor_lr", adamw8bit_tensor_lr<&adamw8bit_cuda>);
}
