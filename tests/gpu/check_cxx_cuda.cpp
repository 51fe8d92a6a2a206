// GPU check of the LibTorch optimizers (run by scripts/gpu_check.sh on a lent GPU; compiled in every
// build so it cannot rot): FusedAdamW and AdamW8bit stepping CUDA params give the bits the same
// optimizers give on CPU params — params, moments, codes, scales, step counts — over steps with
// fresh gradients, including a state whose step count is changed between steps (as a load does:
// the device step counters must follow), with gradients at new addresses every step (one device
// work list per optimizer all the same). Prints one line per case; exit 0 when all are equal, 1 when
// any differs, 2 without a CUDA device.
#include <ATen/ATen.h>
#include <ATen/Context.h>

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "adamw8bit.h"
#include "cuda_step.h"
#include "fused_adamw.h"

using optstate::optim::AdamW8bit;
using optstate::optim::AdamW8bitOptions;
using optstate::optim::AdamW8bitParamState;
using optstate::optim::FusedAdamW;
using optstate::optim::FusedAdamWOptions;
using optstate::optim::FusedAdamWParamState;

namespace {

const std::vector<std::vector<int64_t>> kShapes{{1000, 37}, {4096}, {257, 129}, {3}, {70001}};

std::vector<at::Tensor> make_params(at::ScalarType dtype, const at::Device& device) {
  at::manual_seed(1);
  std::vector<at::Tensor> ps;
  for (const auto& s : kShapes) ps.push_back(at::randn(s).to(dtype).to(device).set_requires_grad(true));
  return ps;
}

// Fresh gradients at new addresses every step (the old ones are kept alive in `keep`), as
// zero_grad(set_to_none=True) or FSDP2 hand the optimizer: the step must re-point its device work
// list at them, not build another.
void set_grads(std::vector<at::Tensor>& cpu, std::vector<at::Tensor>& gpu, int step, std::vector<at::Tensor>& keep) {
  at::manual_seed(100 + step);
  for (size_t i = 0; i < cpu.size(); ++i) {
    const at::Tensor g = (at::randn(cpu[i].sizes()) * 1e-2).to(cpu[i].scalar_type());
    cpu[i].mutable_grad() = g;
    if (gpu[i].grad().defined()) keep.push_back(gpu[i].grad());
    gpu[i].mutable_grad() = g.to(gpu[i].device());
  }
}

// Counts differing elements of a CPU tensor and a GPU tensor (bytes compared: bitwise).
int64_t differing(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() && !b.defined()) return 0;
  if (a.defined() != b.defined() || a.sizes() != b.sizes()) return -1;
  const at::Tensor x = a.contiguous(), y = b.cpu().contiguous();
  if (x.scalar_type() == at::kFloat) return at::ne(x.view(at::kInt), y.view(at::kInt)).sum().item<int64_t>();
  if (x.scalar_type() == at::kBFloat16) return at::ne(x.view(at::kShort), y.view(at::kShort)).sum().item<int64_t>();
  return at::ne(x, y).sum().item<int64_t>();
}

template <class Opt, class State>
bool run_case(const std::string& name, at::ScalarType dtype, std::function<Opt(std::vector<at::Tensor>)> make,
              std::function<std::vector<at::Tensor>(State&)> tensors_of) {
  auto cpu = make_params(dtype, at::kCPU), gpu = make_params(dtype, at::Device(at::kCUDA, 0));
  Opt a = make(cpu), b = make(gpu);
  std::vector<at::Tensor> keep;
  const size_t plans_before = optstate::optim::cuda_plan_count();
  for (int step = 0; step < 4; ++step) {
    set_grads(cpu, gpu, step, keep);
    if (step == 2)  // a changed step count (as after a load): both sides continue from step 7
      for (size_t i = 0; i < cpu.size(); ++i) {
        static_cast<State&>(*a.state()[cpu[i].unsafeGetTensorImpl()]).step(7);
        static_cast<State&>(*b.state()[gpu[i].unsafeGetTensorImpl()]).step(7);
      }
    a.step();
    b.step();
  }
  int64_t diff = 0, total = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    diff += differing(cpu[i].detach(), gpu[i].detach());
    total += cpu[i].numel();
    auto& sa = static_cast<State&>(*a.state()[cpu[i].unsafeGetTensorImpl()]);
    auto& sb = static_cast<State&>(*b.state()[gpu[i].unsafeGetTensorImpl()]);
    if (sa.step() != sb.step() || sa.step() != 9) diff += 1;
    const auto ta = tensors_of(sa), tb = tensors_of(sb);
    for (size_t k = 0; k < ta.size(); ++k) {
      const int64_t d = differing(ta[k], tb[k]);
      diff += d < 0 ? 1 : d;
      total += ta[k].defined() ? ta[k].numel() : 0;
    }
  }
  const size_t plans = optstate::optim::cuda_plan_count() - plans_before;
  std::printf("  C++ %-44s %s; %zu device work list(s) for 4 sets of gradients\n", name.c_str(),
              diff == 0 ? "bitwise equal" : (std::to_string(diff) + " of " + std::to_string(total) + " differ").c_str(),
              plans);
  return diff == 0 && plans == 1;
}

}  // namespace

int main() {
  if (!at::hasCUDA()) {
    std::printf("no CUDA device\n");
    return 2;
  }
  std::printf("== LibTorch optimizers: CUDA params vs CPU params, 4 steps (step count changed after 2)\n");
  bool ok = true;
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16})
    for (bool amsgrad : {false, true}) {
      const std::string tag = std::string(dtype == at::kFloat ? "float32" : "bfloat16") + (amsgrad ? " amsgrad" : "");
      ok &= run_case<FusedAdamW, FusedAdamWParamState>(
          "FusedAdamW " + tag, dtype,
          [&](std::vector<at::Tensor> ps) {
            return FusedAdamW(std::move(ps), FusedAdamWOptions(1e-2).weight_decay(0.1).amsgrad(amsgrad));
          },
          [](FusedAdamWParamState& s) { return std::vector<at::Tensor>{s.exp_avg(), s.exp_avg_sq(), s.max_exp_avg_sq()}; });
      ok &= run_case<AdamW8bit, AdamW8bitParamState>(
          "AdamW8bit " + tag, dtype,
          [&](std::vector<at::Tensor> ps) {
            return AdamW8bit(std::move(ps), AdamW8bitOptions(1e-2).weight_decay(0.1).amsgrad(amsgrad));
          },
          [](AdamW8bitParamState& s) {
            std::vector<at::Tensor> out;
            for (const auto* m : {&s.exp_avg(), &s.exp_avg_sq(), &s.max_exp_avg_sq()})
              for (const at::Tensor* t : {&m->codes, &m->absmax, &m->values}) out.push_back(*t);
            return out;
          });
    }
  return ok ? 0 : 1;
}
