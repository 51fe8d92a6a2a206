// AdamW8bit: AdamW whose moments are kept as blockwise 8-bit state (uint8 codes + one fp32 absmax
// per block, the dynamic maps of torchao/bitsandbytes), bit-compatible with torchao's AdamW8bit.
// Parameters with fewer than min_8bit_size elements (decided on the global size) keep dense fp32
// state. fp32 and bf16 params.
#pragma once

#include <torch/optim/optimizer.h>

#include "tensor_lr.h"

#include <memory>
#include <tuple>
#include <vector>

namespace optstate::optim {

class DeviceSteps;
class WorkingCopies;

struct AdamW8bitOptions : public torch::optim::OptimizerCloneableOptions<AdamW8bitOptions>, public TensorLr {
  AdamW8bitOptions(double lr = 1e-3);  // NOLINT
  TORCH_ARG(double, lr) = 1e-3;
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 1e-2;
  TORCH_ARG(bool, amsgrad) = false;
  TORCH_ARG(int64_t, block_size) = 256;
  TORCH_ARG(int64_t, min_8bit_size) = 4096;

 public:
  // lr as a one-element float32/float64 tensor on the CPU or the params' GPU, read when each step
  // runs, so a step captured in a CUDA graph follows it (tensor_lr.h). Sets lr() to its value.
  AdamW8bitOptions& lr_tensor(at::Tensor t) {
    const double value = adopt_lr_tensor(std::move(t), "AdamW8bit");
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

// One moment: 8-bit (codes + absmax, block_size > 0) or dense fp32 (values).
struct Moment8bit {
  at::Tensor codes, absmax, values;
  bool defined() const { return codes.defined() || values.defined(); }
};

struct AdamW8bitParamState : public torch::optim::OptimizerCloneableParamState<AdamW8bitParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(int64_t, block_size) = 0;  // 0: dense fp32 state
  TORCH_ARG(Moment8bit, exp_avg);
  TORCH_ARG(Moment8bit, exp_avg_sq);
  TORCH_ARG(Moment8bit, max_exp_avg_sq);
};

class AdamW8bit : public torch::optim::Optimizer {
 public:
  explicit AdamW8bit(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                     AdamW8bitOptions defaults = {});
  explicit AdamW8bit(std::vector<at::Tensor> params, AdamW8bitOptions defaults = {});
  // CPU params with the CPU kernel, CUDA params with one launch per param group and GPU.
  at::Tensor step(LossClosure closure = nullptr) override;

  // CUDA params count their steps on the device (no host sync per step). Steps the host does not
  // run, CUDA graph replays, advance those counters but not param_state.step(): step_count reads
  // the device's count (a sync), sync_step_counts writes it into every param state. export_state
  // exports step_count.
  int64_t step_count(const at::Tensor& param) const;
  void sync_step_counts();

  // torch::save(optimizer, path) / torch::load(optimizer, path): LibTorch's optimizer archive in
  // torch::optim::AdamW's layout (archive.h). An archive of torch::optim::AdamW loads here, and
  // dense moments of 8-bit-eligible params are quantized; 8-bit moments are stored as codes +
  // absmax. load checks the whole archive before it changes anything.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  // New zero state for a parameter of `numel` global elements (8-bit when numel >= min_8bit_size).
  static AdamW8bitParamState zero_state(const at::Tensor& p, const AdamW8bitOptions& o);

 private:
  std::shared_ptr<DeviceSteps> device_steps_;  // float32 step counters of CUDA params
  std::shared_ptr<WorkingCopies> working_copies_;  // of params not stored contiguously
};

}  // namespace optstate::optim
