// Argument checks shared by the CPU and CUDA implementations of the optstate.fused_adamw_ and
// optstate.adamw8bit_ ops: list lengths, dtypes, sizes, contiguity, and the device rule of each
// backend (CPU: every tensor on the CPU; CUDA: every tensor, step counters included, on the first
// param's GPU, so one launch covers them and a step needs no host sync). TORCH_CHECK errors name the
// op, the list and the index.
#pragma once

#include <ATen/ATen.h>

namespace optstate::optim {

enum class OpBackend { kCpu, kCuda };

// An op's learning rate: the float overload's number, or the `tensor_lr` overload's one-element
// tensor (torch's tensor lr, which LR schedulers update in place). On the params' GPU the CUDA step
// reads it when the step runs, so a captured CUDA graph follows the schedule.
struct LrArg {
  double value = 0.0;
  at::Tensor tensor;  // defined: the tensor_lr overload
};

// A tensor lr: one float32/float64 element, on the CPU or (CUDA backend) the first param's GPU.
void check_lr(OpBackend backend, const LrArg& lr, const at::Tensor& first_param, const char* op);

// The lr as a host number (reads a GPU tensor lr, which synchronizes: the CUDA step avoids this).
double lr_value(const LrArg& lr);

void check_fused_adamw_args(OpBackend backend, at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                            at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList steps,
                            bool amsgrad);

void check_adamw8bit_args(OpBackend backend, at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                          at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList exp_avg_absmax,
                          at::TensorList exp_avg_sq_absmax, at::TensorList max_exp_avg_sq_absmax, at::TensorList steps,
                          at::IntArrayRef block_sizes, bool amsgrad);

// The state pointers of param i (arguments as checked above) into a CPU or CUDA AdamW8bit tensor
// descriptor (the same field names): codes + absmax for block > 0, dense fp32 moments for block 0.
template <class Descriptor>
void set_adamw8bit_state(Descriptor& t, size_t i, int64_t block, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                         at::TensorList max_exp_avg_sqs, at::TensorList exp_avg_absmax,
                         at::TensorList exp_avg_sq_absmax, at::TensorList max_exp_avg_sq_absmax, bool amsgrad) {
  if (block > 0) {
    t.m_codes = exp_avgs[i].data_ptr<uint8_t>();
    t.v_codes = exp_avg_sqs[i].data_ptr<uint8_t>();
    t.m_absmax = exp_avg_absmax[i].data_ptr<float>();
    t.v_absmax = exp_avg_sq_absmax[i].data_ptr<float>();
    if (amsgrad) {
      t.vmax_codes = max_exp_avg_sqs[i].data_ptr<uint8_t>();
      t.vmax_absmax = max_exp_avg_sq_absmax[i].data_ptr<float>();
    }
  } else {
    t.m = exp_avgs[i].data_ptr<float>();
    t.v = exp_avg_sqs[i].data_ptr<float>();
    if (amsgrad) t.vmax = max_exp_avg_sqs[i].data_ptr<float>();
  }
}

}  // namespace optstate::optim
