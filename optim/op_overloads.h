// The two overloads of each optimizer op (schemas in torch_ops.cpp): a float lr, and `tensor_lr`
// (torch's tensor lr). Each backend (torch_ops.cpp: CPU, torch_ops_cuda.cpp: CUDA) registers these
// over its own implementation, which takes the lr as an LrArg.
#pragma once

#include <ATen/ATen.h>

#include "op_checks.h"

namespace optstate::optim {

using FusedAdamWImpl = void (*)(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                                at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList steps,
                                const LrArg& lr, double beta1, double beta2, double eps, double weight_decay,
                                bool amsgrad, bool maximize);
using AdamW8bitImpl = void (*)(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                               at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                               at::TensorList exp_avg_absmax, at::TensorList exp_avg_sq_absmax,
                               at::TensorList max_exp_avg_sq_absmax, at::TensorList steps,
                               at::IntArrayRef block_sizes, const LrArg& lr, double beta1, double beta2, double eps,
                               double weight_decay, bool amsgrad);

template <FusedAdamWImpl kImpl>
void fused_adamw_float_lr(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                          at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList steps, double lr,
                          double beta1, double beta2, double eps, double weight_decay, bool amsgrad, bool maximize) {
  kImpl(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, {lr, {}}, beta1, beta2, eps, weight_decay,
        amsgrad, maximize);
}

template <FusedAdamWImpl kImpl>
void fused_adamw_tensor_lr(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                           at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList steps,
                           const at::Tensor& lr, double beta1, double beta2, double eps, double weight_decay,
                           bool amsgrad, bool maximize) {
  kImpl(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, {0.0, lr}, beta1, beta2, eps, weight_decay,
        amsgrad, maximize);
}

template <AdamW8bitImpl kImpl>
void adamw8bit_float_lr(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                        at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList exp_avg_absmax,
                        at::TensorList exp_avg_sq_absmax, at::TensorList max_exp_avg_sq_absmax, at::TensorList steps,
                        at::IntArrayRef block_sizes, double lr, double beta1, double beta2, double eps,
                        double weight_decay, bool amsgrad) {
  kImpl(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, exp_avg_absmax, exp_avg_sq_absmax,
        max_exp_avg_sq_absmax, steps, block_sizes, {lr, {}}, beta1, beta2, eps, weight_decay, amsgrad);
}

template <AdamW8bitImpl kImpl>
void adamw8bit_tensor_lr(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                         at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList exp_avg_absmax,
                         at::TensorList exp_avg_sq_absmax, at::TensorList max_exp_avg_sq_absmax, at::TensorList steps,
                         at::IntArrayRef block_sizes, const at::Tensor& lr, double beta1, double beta2, double eps,
                         double weight_decay, bool amsgrad) {
  kImpl(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, exp_avg_absmax, exp_avg_sq_absmax,
        max_exp_avg_sq_absmax, steps, block_sizes, {0.0, lr}, beta1, beta2, eps, weight_decay, amsgrad);
}

}  // namespace optstate::optim
