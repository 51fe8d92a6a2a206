#include "tensor_lr.h"

#include <ATen/core/grad_mode.h>

#include "cuda_step.h"

namespace optstate::optim {

double TensorLr::adopt_lr_tensor(at::Tensor t, const char* optimizer) {
  if (!t.defined()) {
    lr_tensor_ = at::Tensor();
    return 0.0;
  }
  TORCH_CHECK(t.numel() == 1 && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble), optimizer,
              ": lr_tensor must hold one float32 or float64 element, got ", t.scalar_type(), " ", t.sizes());
  TORCH_CHECK(t.device().is_cpu() || t.is_cuda(), optimizer, ": lr_tensor must be on the CPU or a GPU, got ",
              t.device());
  written_ = t.item<double>();
  lr_tensor_ = std::move(t);
  return written_;
}

void TensorLr::write_lr_tensor(double lr) {
  if (!lr_tensor_.defined()) return;
  at::NoGradGuard no_grad;
  lr_tensor_.fill_(lr);
  written_ = lr;
}

LrArg TensorLr::step_lr(double lr, const char* optimizer) {
  if (!lr_tensor_.defined()) return {lr, {}};
  if (lr != written_) {
    TORCH_CHECK(!cuda_stream_capturing(), optimizer,
                ": options.lr() was changed directly while a CUDA graph is being captured; the write into "
                "lr_tensor would be replayed with every step. Change the lr with set_lr() (what LibTorch's "
                "schedulers call) or by writing lr_tensor itself");
    write_lr_tensor(lr);
  }
  return {lr, lr_tensor_};
}

}  // namespace optstate::optim
