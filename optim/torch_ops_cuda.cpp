// The CUDA implementations of the optstate.fused_adamw_ and optstate.adamw8bit_ ops (cuda_step.h).
// Built into the ops library only where LibTorch has CUDA.
#include <torch/library.h>

#include "cuda_step.h"

namespace optstate::optim {
namespace {

// Each op's float-lr and tensor_lr overloads (torch_ops.cpp has the schemas).
void fused_adamw_op(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                    at::TensorList max_exp_avg_sqs, at::TensorList steps, double lr, double beta1, double beta2,
                    double eps, double weight_decay, bool amsgrad, bool maximize) {
  fused_adamw_cuda(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, {lr, {}}, beta1, beta2, eps,
                   weight_decay, amsgrad, maximize);
}
void fused_adamw_tensor_lr_op(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                              at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList steps,
                              const at::Tensor& lr, double beta1, double beta2, double eps, double weight_decay,
                              bool amsgrad, bool maximize) {
  fused_adamw_cuda(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, {0.0, lr}, beta1, beta2, eps,
                   weight_decay, amsgrad, maximize);
}
void adamw8bit_op(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                  at::TensorList max_exp_avg_sqs, at::TensorList exp_avg_absmax, at::TensorList exp_avg_sq_absmax,
                  at::TensorList max_exp_avg_sq_absmax, at::TensorList steps, at::IntArrayRef block_sizes, double lr,
                  double beta1, double beta2, double eps, double weight_decay, bool amsgrad) {
  adamw8bit_cuda(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, exp_avg_absmax, exp_avg_sq_absmax,
                 max_exp_avg_sq_absmax, steps, block_sizes, {lr, {}}, beta1, beta2, eps, weight_decay, amsgrad);
}
void adamw8bit_tensor_lr_op(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                            at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList exp_avg_absmax,
                            at::TensorList exp_avg_sq_absmax, at::TensorList max_exp_avg_sq_absmax,
                            at::TensorList steps, at::IntArrayRef block_sizes, const at::Tensor& lr, double beta1,
                            double beta2, double eps, double weight_decay, bool amsgrad) {
  adamw8bit_cuda(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, exp_avg_absmax, exp_avg_sq_absmax,
                 max_exp_avg_sq_absmax, steps, block_sizes, {0.0, lr}, beta1, beta2, eps, weight_decay, amsgrad);
}

}  // namespace
}  // namespace optstate::optim

TORCH_LIBRARY_IMPL(optstate, CUDA, m) {
  m.impl("fused_adamw_", optstate::optim::fused_adamw_op);
  m.impl("fused_adamw_.tensor_lr", optstate::optim::fused_adamw_tensor_lr_op);
  m.impl("adamw8bit_", optstate::optim::adamw8bit_op);
  m.impl("adamw8bit_.tensor_lr", optstate::optim::adamw8bit_tensor_lr_op);
}
