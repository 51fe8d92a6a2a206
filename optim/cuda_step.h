// One optimizer step over lists of CUDA tensors with the kernels in cuda/ (docs/cuda.md): the
// CUDA implementations of the optstate.fused_adamw_ / optstate.adamw8bit_ ops and the LibTorch
// optimizers' path for CUDA params. Arguments as the ops take them (torch_ops.cpp); every tensor on
// one GPU, `steps` are float32 scalar tensors on it (incremented on the device). Asynchronous on the
// current stream, no host sync (a tensor lr on the GPU is read there when the step runs; one on the
// CPU is read on the host). Where LibTorch has no CUDA these throw (cuda_kernels_built() false).
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "op_checks.h"  // LrArg

namespace optstate::optim {

bool cuda_kernels_built();

// Whether the current CUDA stream of GPU `device` (-1: the current GPU) is capturing a graph (false
// where LibTorch has no CUDA).
bool cuda_stream_capturing(int device = -1);

// The kernels' image the runtime takes for GPU `device`, in words ("sm_90 code (PTX version 90) on
// a compute capability 9.0 GPU; built for 90-real 90-virtual"); a clear error naming the GPU's
// compute capability and the CMake option to rebuild with where the build holds none it can run.
// Checked before a GPU's first step.
std::string cuda_kernel_image(int device);

// How many device work lists (plans) the CUDA steps have built: one per set of tensors an optimizer
// steps, whatever its gradients' addresses (for the GPU check).
size_t cuda_plan_count();

// The step-dependent scalars the CUDA kernels compute for each value of `steps` (float32 on a GPU):
// an [n, 4] float32 tensor on it of FusedAdamW's -lr / bc1 and sqrt(bc2), and AdamW8bit's bc1 and
// sqrt(bc2). The GPU check compares them with adamw_step_scalars / adamw8bit_step_scalars.
at::Tensor cuda_step_scalars(const at::Tensor& steps, double lr, double beta1, double beta2, double eps,
                             double weight_decay);

void fused_adamw_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                      at::TensorList max_exp_avg_sqs, at::TensorList steps, const LrArg& lr, double beta1,
                      double beta2, double eps, double weight_decay, bool amsgrad, bool maximize);

// block_sizes[i] > 0: exp_avgs[i] etc. are uint8 codes with fp32 absmax lists; 0: dense fp32 moments.
void adamw8bit_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                    at::TensorList max_exp_avg_sqs, at::TensorList exp_avg_absmax, at::TensorList exp_avg_sq_absmax,
                    at::TensorList max_exp_avg_sq_absmax, at::TensorList steps, at::IntArrayRef block_sizes,
                    const LrArg& lr, double beta1, double beta2, double eps, double weight_decay, bool amsgrad);

}  // namespace optstate::optim
