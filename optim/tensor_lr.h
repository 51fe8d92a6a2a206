// The optimizers' optional tensor learning rate (as torch.optim's `lr=torch.tensor(...)`): a
// one-element float32/float64 tensor, on the CPU or the params' GPU, read when each step runs (by the
// kernel, on a GPU), so a step captured in a CUDA graph follows every change to it. The options'
// double lr() stays, as LibTorch's schedulers need it: set_lr writes the new value into the tensor in
// place, and a step writes lr() into it when lr() was set directly since (refused while a CUDA graph
// is being captured: the write would be replayed with the step).
#pragma once

#include <ATen/ATen.h>

#include "op_checks.h"  // LrArg

namespace optstate::optim {

class TensorLr {
 public:
  const at::Tensor& lr_tensor() const { return lr_tensor_; }

  // For the optimizers' step: {lr} without a tensor; else the tensor, after writing `lr` (the
  // options' lr()) into it if that was set directly since the tensor was last written.
  LrArg step_lr(double lr, const char* optimizer);

 protected:
  // Takes `t` as the lr; returns its current value (one host read) for the options' lr().
  double adopt_lr_tensor(at::Tensor t, const char* optimizer);
  // set_lr's part: the new value into the tensor, in place (an asynchronous fill on a GPU).
  void write_lr_tensor(double lr);

 private:
  at::Tensor lr_tensor_;
  double written_ = 0.0;  // the value the tensor was last given through these options
};

}  // namespace optstate::optim
