// Argument checks shared by the CPU and CUDA implementations of the optstate.fused_adamw_ and
// optstate.adamw8bit_ ops: list lengths, dtypes, sizes, contiguity, and the device rule of each
// backend (CPU: every tensor on the CPU; CUDA: every tensor, step counters included, on the first
// param's GPU, so one launch covers them and a step needs no host sync). TORCH_CHECK errors name the
// op, the list and the index.
#pragma once

#include <ATen/ATen.h>

namespace optstate::optim {

enum class OpBackend { kCpu, kCuda };

void check_fused_adamw_args(OpBackend backend, at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                            at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList steps,
                            bool amsgrad);

void check_adamw8bit_args(OpBackend backend, at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                          at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList exp_avg_absmax,
                          at::TensorList exp_avg_sq_absmax, at::TensorList max_exp_avg_sq_absmax, at::TensorList steps,
                          at::IntArrayRef block_sizes, bool amsgrad);

}  // namespace optstate::optim
