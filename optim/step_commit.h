// What the LibTorch optimizers' step() shares: it checks every group and param first and changes
// nothing until all pass (new param state is held aside, then committed), and it advances a param's
// step count only with its update, so a refused step (a bad grad, state that does not fit, a
// refused CUDA launch) leaves each param's count equal to the updates it has had.
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <map>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cuda_step.h"
#include "device_steps.h"

namespace optstate::optim {

// One param a step updates: its state, and whether this step adds its amsgrad moment; `work` is
// the tensor the kernels update (the param, or its working copy: WorkingCopies) and `grad` its
// gradient in logical order.
template <class State>
struct StepParam {
  at::Tensor p;
  State* st;
  bool needs_max = false;
  at::Tensor work;
  at::Tensor grad;

  // After the param's update: a working copy goes back into the param.
  void write_back() const {
    if (!work.is_same(p)) p.copy_(work);
  }
};

// One param group's share of a step: its options and lr, its CPU params, and its CUDA params by GPU
// (one launch each).
template <class Options, class State>
struct StepGroup {
  const Options* o;
  LrArg lr;
  std::vector<StepParam<State>> cpu;
  std::map<c10::DeviceIndex, std::vector<StepParam<State>>> cuda;
};

// Param states made by this step, kept out of the optimizer's state until every check has passed.
class NewStates {
 public:
  explicit NewStates(const char* optimizer) : optimizer_(optimizer) {}

  // The state of `p`: the optimizer's, or one made earlier in this step (a param listed twice).
  template <class StateMap>
  torch::optim::OptimizerParamState* find(const StateMap& state, const at::Tensor& p) const {
    const auto it = state.find(p.unsafeGetTensorImpl());
    if (it != state.end() && it->second) return it->second.get();
    const auto made = made_.find(p.unsafeGetTensorImpl());
    return made == made_.end() ? nullptr : made->second.get();
  }

  // Before this step makes new state tensors for `p`: a CUDA graph being captured would record
  // their zero fills without running them, and the state would hold whatever the graph's memory
  // held, so that is refused with what to do.
  void before_new_tensors(const at::Tensor& p) const {
    if (p.is_cuda())
      TORCH_CHECK(!cuda_stream_capturing(p.device().index()), optimizer_,
                  ": the first step of a param makes its state, which a CUDA graph cannot record; run one "
                  "step eagerly before capturing (a warm-up, as torch.cuda.graph asks) and capture the "
                  "steps after it");
  }

  template <class State>
  State* add(const at::Tensor& p, std::unique_ptr<State> st) {
    State* raw = st.get();
    made_[p.unsafeGetTensorImpl()] = std::move(st);
    return raw;
  }

  template <class StateMap>
  void commit(StateMap& state) {
    for (auto& [key, st] : made_) state[key] = std::move(st);
    made_.clear();
  }

 private:
  const char* optimizer_;
  std::unordered_map<void*, std::unique_ptr<torch::optim::OptimizerParamState>> made_;
};

// Params not stored as one contiguous run in logical order (a channels_last conv weight, a
// transposed view), which torch's AdamW steps as they are: the kernels take flat tensors in logical
// (row-major) order, as the state and its 8-bit blocks are laid out, so such a param is stepped
// through a contiguous copy, refreshed from it before the update and written back after. The copy
// is kept between steps, so a CUDA step finds the same tensors (its cached plan, a graph capture).
class WorkingCopies {
 public:
  // The tensor the kernels update for `p`: `p` itself, or its working copy holding p's values.
  at::Tensor refreshed(const at::Tensor& p, const NewStates& fresh) {
    if (p.is_contiguous()) return p;
    at::Tensor& w = copies_[p.unsafeGetTensorImpl()];
    if (!w.defined() || w.sizes() != p.sizes() || w.scalar_type() != p.scalar_type() || w.device() != p.device()) {
      fresh.before_new_tensors(p);
      w = at::empty(p.sizes(), p.options().memory_format(at::MemoryFormat::Contiguous));
    }
    w.copy_(p);
    return w;
  }

 private:
  std::unordered_map<void*, at::Tensor> copies_;
};

// Runs one CUDA launch over `params` (whose device counters `steps` gave out), then counts the step
// on the host; a launch that throws counts nothing, and the device counters are refilled from the
// host counts at the next step.
template <class State, class Launch>
void launch_then_count(DeviceSteps& steps, const std::vector<StepParam<State>>& params, Launch&& launch) {
  try {
    launch();
  } catch (...) {
    for (const auto& x : params) steps.forget(x.p);
    throw;
  }
  for (const auto& x : params) {
    x.write_back();
    x.st->step(x.st->step() + 1);
  }
}

}  // namespace optstate::optim
