// The CUDA implementations of the optstate.fused_adamw_ and optstate.adamw8bit_ ops (cuda_step.h).
// Built into the ops library only where LibTorch has CUDA.
#include <torch/library.h>

#include "cuda_step.h"

TORCH_LIBRARY_IMPL(optstate, CUDA, m) {
  m.impl("fused_adamw_", optstate::optim::fused_adamw_cuda);
  m.impl("adamw8bit_", optstate::optim::adamw8bit_cuda);
}
