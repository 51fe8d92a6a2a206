// One optimizer step over lists of CUDA tensors with the kernels in cuda/ (docs/cuda.md): the
// CUDA implementations of the optstate.fused_adamw_ / optstate.adamw8bit_ ops and the LibTorch
// optimizers' path for CUDA params. Arguments as the ops take them (torch_ops.cpp); every tensor on
// one GPU, `steps` are float32 scalar tensors on it (incremented on the device). Asynchronous on the
// current stream, no host sync (a tensor lr on the GPU is read there when the step runs; one on the
// CPU is read on the host). Where LibTorch has no CUDA these throw (cuda_kernels_built() false).
#pragma once

#include <ATen/ATen.h>

#include "op_checks.h"  // LrArg

namespace optstate::optim {

bool cuda_kernels_built();

// Whether the current CUDA stream is capturing a graph (false where LibTorch has no CUDA).
bool cuda_stream_capturing();

// How many device work lists (plans) the CUDA steps have built: one per set of tensors an optimizer
// steps, whatever its gradients' addresses (for the GPU check).
size_t cuda_plan_count();

void fused_adamw_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                      at::TensorList max_exp_avg_sqs, at::TensorList steps, const LrArg& lr, double beta1,
                      double beta2, double eps, double weight_decay, bool amsgrad, bool maximize);

// block_sizes[i] > 0: exp_avgs[i] etc. are uint8 codes with fp32 absmax lists; 0: dense fp32 moments.
void adamw8bit_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                    at::TensorList max_exp_avg_sqs, at::TensorList exp_avg_absmax, at::TensorList exp_avg_sq_absmax,
                    at::TensorList max_exp_avg_sq_absmax, at::TensorList steps, at::IntArrayRef block_sizes,
                    const LrArg& lr, double beta1, double beta2, double eps, double weight_decay, bool amsgrad);

}  // namespace optstate::optim
