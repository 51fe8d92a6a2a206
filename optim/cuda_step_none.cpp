// cuda_step.h where LibTorch has no CUDA (the CPU wheel): CUDA params get a clear error.
#include "cuda_step.h"

namespace optstate::optim {

bool cuda_kernels_built() { return false; }

bool cuda_stream_capturing(int) { return false; }

size_t cuda_plan_count() { return 0; }

std::string cuda_kernel_image(int) {
  TORCH_CHECK(false, "optstate: this build has no CUDA kernels (LibTorch without CUDA, or OPTSTATE_WITH_CUDA=OFF)");
}

at::Tensor cuda_step_scalars(const at::Tensor&, double, double, double, double, double) {
  TORCH_CHECK(false, "optstate: this build has no CUDA kernels (LibTorch without CUDA, or OPTSTATE_WITH_CUDA=OFF)");
}

void fused_adamw_cuda(at::TensorList, at::TensorList, at::TensorList, at::TensorList, at::TensorList, at::TensorList,
                      const LrArg&, double, double, double, double, bool, bool) {
  TORCH_CHECK(false, "optstate FusedAdamW: CUDA tensors, but this build of optstate has no CUDA kernels "
                     "(LibTorch without CUDA, or OPTSTATE_WITH_CUDA=OFF)");
}

void adamw8bit_cuda(at::TensorList, at::TensorList, at::TensorList, at::TensorList, at::TensorList, at::TensorList,
                    at::TensorList, at::TensorList, at::TensorList, at::IntArrayRef, const LrArg&, double, double,
                    double, double, bool) {
  TORCH_CHECK(false, "optstate AdamW8bit: CUDA tensors, but this build of optstate has no CUDA kernels "
                     "(LibTorch without CUDA, or OPTSTATE_WITH_CUDA=OFF)");
}

}  // namespace optstate::optim
