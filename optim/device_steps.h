// The LibTorch optimizers keep `step` as an int64 in their param state (as torch::optim::AdamW).
// The CUDA kernels count steps in a float32 tensor on the param's GPU (no host sync per step); this
// keeps one per param, refilled from the host count only when that count was changed behind its
// back (a loaded or edited state). Steps the host does not run (CUDA graph replays) advance only
// the device counter; current() reads it back, so the host can catch up.
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <unordered_map>

namespace optstate::optim {

class DeviceSteps {
 public:
  // The device counter of `p` holding `completed` steps; the coming CUDA step adds one to it.
  at::Tensor before_step(const at::Tensor& p, int64_t completed) {
    Entry& e = entries_[p.unsafeGetTensorImpl()];
    if (!e.count.defined() || e.count.device() != p.device()) {
      e.count = at::empty({}, p.options().dtype(at::kFloat));
      e.host = -1;
    }
    if (e.host != completed) e.count.fill_(static_cast<double>(completed));  // a fill launch, no sync
    e.host = completed + 1;
    return e.count;
  }

  // The steps `p` has completed: its device counter (a device sync) when the host's count
  // `completed` is the one the device was last given, else `completed` (the host changed it, as a
  // load does; the next step refills the device from it).
  int64_t current(const at::Tensor& p, int64_t completed) const {
    const auto it = entries_.find(p.unsafeGetTensorImpl());
    if (it == entries_.end() || !it->second.count.defined() || it->second.host != completed) return completed;
    return static_cast<int64_t>(it->second.count.item<float>());
  }

  // The host's count of `p` is now `completed`, read from the device by current().
  void caught_up(const at::Tensor& p, int64_t completed) {
    const auto it = entries_.find(p.unsafeGetTensorImpl());
    if (it != entries_.end()) it->second.host = completed;
  }

  // The step that took `p`'s counter did not run (its launch was refused): the next step refills
  // the counter from the host's count.
  void forget(const at::Tensor& p) {
    const auto it = entries_.find(p.unsafeGetTensorImpl());
    if (it != entries_.end()) it->second.host = -1;
  }

  // The optimizers' step_count and sync_step_counts, over param states of type State.
  template <class State>
  static int64_t step_count(const torch::optim::Optimizer& opt, const DeviceSteps* steps, const at::Tensor& p) {
    const auto it = opt.state().find(p.unsafeGetTensorImpl());
    if (it == opt.state().end()) return 0;
    const int64_t host = static_cast<const State&>(*it->second).step();
    return steps ? steps->current(p, host) : host;
  }
  template <class State>
  static void sync(torch::optim::Optimizer& opt, DeviceSteps* steps) {
    if (!steps) return;
    for (auto& group : opt.param_groups())
      for (auto& p : group.params()) {
        const auto it = opt.state().find(p.unsafeGetTensorImpl());
        if (it == opt.state().end()) continue;
        auto& st = static_cast<State&>(*it->second);
        const int64_t now = steps->current(p, st.step());
        st.step(now);
        steps->caught_up(p, now);
      }
  }

 private:
  struct Entry {
    at::Tensor count;
    int64_t host = -1;
  };
  std::unordered_map<const void*, Entry> entries_;
};

}  // namespace optstate::optim
