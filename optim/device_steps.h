// The LibTorch optimizers keep `step` as an int64 in their param state (as torch::optim::AdamW).
// The CUDA kernels count steps in a float32 tensor on the param's GPU (no host sync per step); this
// keeps one per param, refilled from the host count only when that count was changed behind its
// back (a loaded or edited state), so both always agree.
#pragma once

#include <ATen/ATen.h>

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

 private:
  struct Entry {
    at::Tensor count;
    int64_t host = -1;
  };
  std::unordered_map<const void*, Entry> entries_;
};

}  // namespace optstate::optim
