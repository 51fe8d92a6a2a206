// FusedAdamW: torch.optim.AdamW semantics (decoupled weight decay first, bias correction, amsgrad,
// maximize) as a LibTorch optimizer whose step is one fused pass per element over all parameters.
// fp32 and bf16 params; state is always fp32.
#pragma once

#include <torch/optim/optimizer.h>

#include "tensor_lr.h"

#include <memory>
#include <tuple>
#include <vector>

namespace optstate::optim {

class DeviceSteps;
class WorkingCopies;

struct FusedAdamWOptions : public torch::optim::OptimizerCloneableOptions<FusedAdamWOptions>, public TensorLr {
  FusedAdamWOptions(double lr = 1e-3);  // NOLINT: implicit like torch::optim::AdamWOptions
  TORCH_ARG(double, lr) = 1e-3;
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 1e-2;
  TORCH_ARG(bool, amsgrad) = false;
  TORCH_ARG(bool, maximize) = false;

 public:
  // lr as a one-element float32/float64 tensor on the CPU or the params' GPU, read when each step
  // runs, so a step captured in a CUDA graph follows it (tensor_lr.h). Sets lr() to its value.
  FusedAdamWOptions& lr_tensor(at::Tensor t) {
    const double value = adopt_lr_tensor(std::move(t), "FusedAdamW");
    if (lr_tensor().defined()) lr(value);
    return *this;
  }
  using TensorLr::lr_tensor;
  double get_lr() const override { return lr(); }
  // What LibTorch's LR schedulers call: also writes lr_tensor in place.
  void set_lr(const double lr) override {
    this->lr(lr);
    write_lr_tensor(lr);
  }
};

struct FusedAdamWParamState : public torch::optim::OptimizerCloneableParamState<FusedAdamWParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(at::Tensor, exp_avg);
  TORCH_ARG(at::Tensor, exp_avg_sq);
  TORCH_ARG(at::Tensor, max_exp_avg_sq) = {};
};

class FusedAdamW : public torch::optim::Optimizer {
 public:
  explicit FusedAdamW(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                      FusedAdamWOptions defaults = {});
  explicit FusedAdamW(std::vector<at::Tensor> params, FusedAdamWOptions defaults = {});

  // Runs the closure (if any) under grad mode, then updates every parameter that has a gradient:
  // CPU params with the CPU kernel, CUDA params with one launch per param group and GPU (the
  // result is the same bits; docs/cuda.md).
  at::Tensor step(LossClosure closure = nullptr) override;

  // CUDA params count their steps on the device (no host sync per step). Steps the host does not
  // run, CUDA graph replays, advance those counters but not param_state.step(): step_count reads
  // the device's count (a sync), sync_step_counts writes it into every param state. export_state
  // exports step_count.
  int64_t step_count(const at::Tensor& param) const;
  void sync_step_counts();

  // torch::save(optimizer, path) / torch::load(optimizer, path): LibTorch's optimizer archive in
  // torch::optim::AdamW's layout (archive.h). An archive of torch::optim::AdamW loads here, and one
  // of FusedAdamW into torch::optim::AdamW; load checks the whole archive before it changes anything.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  std::shared_ptr<DeviceSteps> device_steps_;  // float32 step counters of CUDA params
  std::shared_ptr<WorkingCopies> working_copies_;  // of params not stored contiguously
};

}  // namespace optstate::optim
