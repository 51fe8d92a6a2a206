// GPU check of the LibTorch optimizers (run by scripts/gpu_check.sh on a lent GPU; compiled in every
// build so it cannot rot): FusedAdamW and AdamW8bit stepping CUDA params give the bits the same
// optimizers give on CPU params — params, moments, codes, scales, step counts — over steps with
// fresh gradients, including a state whose step count is changed between steps (as a load does:
// the device step counters must follow) and a torch::save / torch::load round trip into a new
// optimizer of the GPU params, with gradients at new addresses every step (one device
// work list per optimizer all the same). Where LibTorch has CUDA it also captures a step in a CUDA
// graph with lr_tensor on the GPU and changes the lr (set_lr, as LibTorch's schedulers do) before
// each replay. And the step-dependent scalars the kernels compute on the device equal the CPU
// kernels' over 1.3M step values at 4 pairs of betas. Prints one line per case; exit 0 when all are
// equal, 1 when any differs, 2 without a CUDA device.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <torch/serialize.h>

#if defined(OPTSTATE_CXX_CUDA_GRAPHS)
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <cstdio>
#include <cstring>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "adamw8bit.h"
#include "adamw8bit_kernel.h"
#include "adamw_kernel.h"
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

// `transposed`: the 2-d params stored column-major (the same values), as a transposed view is:
// the optimizers step them through a contiguous working copy.
std::vector<at::Tensor> make_params(at::ScalarType dtype, const at::Device& device, bool transposed = false) {
  at::manual_seed(1);
  std::vector<at::Tensor> ps;
  for (const auto& s : kShapes) {
    at::Tensor t = at::randn(s).to(dtype).to(device);
    if (transposed && t.dim() == 2) t = t.t().contiguous().t();
    ps.push_back(t.set_requires_grad(true));
  }
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
              std::function<std::vector<at::Tensor>(State&)> tensors_of, bool transposed = false) {
  auto cpu = make_params(dtype, at::kCPU), gpu = make_params(dtype, at::Device(at::kCUDA, 0), transposed);
  Opt a = make(cpu), b0 = make(gpu);
  Opt* live = &b0;
  std::optional<Opt> loaded;
  std::vector<at::Tensor> keep;
  const size_t plans_before = optstate::optim::cuda_plan_count();
  for (int step = 0; step < 4; ++step) {
    set_grads(cpu, gpu, step, keep);
    if (step == 2) {  // a changed step count (as after a load): both sides continue from step 7
      for (size_t i = 0; i < cpu.size(); ++i) {
        static_cast<State&>(*a.state()[cpu[i].unsafeGetTensorImpl()]).step(7);
        static_cast<State&>(*b0.state()[gpu[i].unsafeGetTensorImpl()]).step(7);
      }
      // and the GPU side goes on in a new optimizer, torch::load'ed from b0's torch::save archive
      // (CPU tensors in the archive; the state must land on the params' GPU)
      std::stringstream archive;
      torch::save(b0, archive);
      loaded.emplace(make(gpu));
      torch::load(*loaded, archive);
      live = &*loaded;
    }
    a.step();
    live->step();
  }
  Opt& b = *live;
  int64_t diff = 0, total = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    diff += differing(cpu[i].detach(), gpu[i].detach());
    total += cpu[i].numel();
    auto& sa = static_cast<State&>(*a.state()[cpu[i].unsafeGetTensorImpl()]);
    auto& sb = static_cast<State&>(*b.state()[gpu[i].unsafeGetTensorImpl()]);
    if (sa.step() != sb.step() || sa.step() != 9) diff += 1;
    if (transposed && gpu[i].dim() == 2 && gpu[i].is_contiguous()) diff += 1;  // its layout kept
    const auto ta = tensors_of(sa), tb = tensors_of(sb);
    for (size_t k = 0; k < ta.size(); ++k) {
      const int64_t d = differing(ta[k], tb[k]);
      diff += d < 0 ? 1 : d;
      total += ta[k].defined() ? ta[k].numel() : 0;
    }
  }
  // One work list per set of state tensors (b0's, then the loaded optimizer's), not per gradients.
  const size_t plans = optstate::optim::cuda_plan_count() - plans_before;
  std::printf("  C++ %-44s %s; %zu device work lists for 4 sets of gradients and 2 of state\n", name.c_str(),
              diff == 0 ? "bitwise equal" : (std::to_string(diff) + " of " + std::to_string(total) + " differ").c_str(),
              plans);
  return diff == 0 && plans == 2;
}

// The step-dependent scalars (bias corrections) the kernels compute on the device against the CPU
// kernels' for every step up to 2^20 and a stride to 2^24, at common betas: the host and device pow
// must agree to the last bit after rounding to fp32 or a long run's step stops being bitwise equal.
bool step_scalars_case() {
  std::vector<float> steps;
  for (int64_t t = 1; t <= (int64_t{1} << 20); ++t) steps.push_back(static_cast<float>(t));
  for (int64_t t = (int64_t{1} << 20) + 61; t <= (int64_t{1} << 24); t += 61) steps.push_back(static_cast<float>(t));
  const auto n = static_cast<int64_t>(steps.size());
  const at::Tensor dev_steps = at::from_blob(steps.data(), {n}, at::kFloat).to(at::Device(at::kCUDA, 0));
  int64_t diff = 0, compared = 0;
  std::string first;
  const std::vector<std::pair<double, double>> betas{{0.9, 0.999}, {0.9, 0.95}, {0.95, 0.99}, {0.8, 0.9999}};
  for (const auto& [b1, b2] : betas) {
    const optstate::optim::AdamWHyper h{3e-4, b1, b2, 1e-8, 0.1, false, false};
    const at::Tensor dev = optstate::optim::cuda_step_scalars(dev_steps, h.lr, b1, b2, h.eps, h.weight_decay).cpu();
    const float* d = dev.const_data_ptr<float>();
    std::vector<int64_t> bad(static_cast<size_t>(n), 0);
    at::parallel_for(0, n, 4096, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const auto a = optstate::optim::adamw_step_scalars(h, static_cast<int64_t>(steps[i]));
        const auto b = optstate::optim::adamw8bit_step_scalars(h, steps[i]);
        const float host[4] = {a.neg_step_size, a.bc2_sqrt, b.bc1, b.bc2_sqrt};
        bad[i] = std::memcmp(host, d + 4 * i, sizeof host) != 0;
      }
    });
    for (int64_t i = 0; i < n; ++i)
      if (bad[i] && diff++ == 0) first = "betas (" + std::to_string(b1) + ", " + std::to_string(b2) + ") step " +
                                         std::to_string(static_cast<int64_t>(steps[i]));
    compared += n;
  }
  const std::string verdict = diff == 0 ? "bitwise equal at all " + std::to_string(compared) + " steps"
                                        : std::to_string(diff) + " of " + std::to_string(compared) + " differ, first " + first;
  std::printf("  C++ %-44s %s\n", "step scalars, device vs host (4 beta pairs)", verdict.c_str());
  return diff == 0;
}

#if defined(OPTSTATE_CXX_CUDA_GRAPHS)
// One step captured in a CUDA graph, lr_tensor (float32) on the GPU; before each of 3 replays, new
// gradients are copied into the captured ones and set_lr writes a new lr into the tensor. Compared
// with eager steps of the same optimizer given each lr as a double. Replays advance the device step
// counters, which the kernels use; the host's param_state.step() counts the capture once until
// sync_step_counts reads them back, after which an eager step continues in step with the reference.
template <class Opt, class Options, class State>
bool graph_case(const std::string& name, std::function<std::vector<at::Tensor>(State&)> tensors_of) {
  const at::Device dev(at::kCUDA, 0);
  auto pg = make_params(at::kFloat, dev), pe = make_params(at::kFloat, dev);
  const at::Tensor lr = at::full({}, 1e-2, at::TensorOptions().dtype(at::kFloat).device(dev));
  const auto held = [](double x) { return static_cast<double>(static_cast<float>(x)); };
  Opt g(pg, Options().lr_tensor(lr).weight_decay(0.1));
  Opt e(pe, Options(held(1e-2)).weight_decay(0.1));
  for (auto& p : pg) p.mutable_grad() = at::zeros_like(p);  // the captured gradient buffers
  auto new_grads = [&](int step) {
    at::manual_seed(300 + step);
    for (size_t i = 0; i < pg.size(); ++i) {
      const at::Tensor grad = (at::randn(pg[i].sizes()) * 1e-2).to(dev);
      pg[i].grad().copy_(grad);
      pe[i].mutable_grad() = grad.clone();
    }
  };
  const at::cuda::CUDAStream side = at::cuda::getStreamFromPool();
  bool ok = true, counts_ok = false;
  {
    const c10::cuda::CUDAStreamGuard guard(side);
    for (int step = 0; step < 2; ++step) {  // warm-up: state and the device work list exist before capture
      new_grads(step);
      g.step();
      e.step();
    }
    side.synchronize();
    at::cuda::CUDAGraph graph;
    graph.capture_begin();
    g.step();
    graph.capture_end();
    auto& go = static_cast<Options&>(g.param_groups()[0].options());
    auto& eo = static_cast<Options&>(e.param_groups()[0].options());
    for (double next : {5e-3, 2e-3, 8e-4}) {
      new_grads(static_cast<int>(next * 1e4));
      go.set_lr(next);  // writes lr_tensor in place; the replay reads it
      eo.set_lr(held(next));
      graph.replay();
      e.step();
    }
    side.synchronize();
    // The host counted the captured step once (3); the device counters saw every replay (5).
    // sync_step_counts brings the host up to date, and an eager step continues from there.
    auto host_step = [&] { return static_cast<State&>(*g.state()[pg[0].unsafeGetTensorImpl()]).step(); };
    counts_ok = host_step() == 3 && g.step_count(pg[0]) == 5;
    g.sync_step_counts();
    counts_ok = counts_ok && host_step() == 5;
    new_grads(99);
    g.step();
    e.step();
    side.synchronize();
    counts_ok = counts_ok && host_step() == 6 && g.step_count(pg[0]) == 6;
  }
  int64_t diff = 0, total = 0;
  for (size_t i = 0; i < pg.size(); ++i) {
    diff += differing(pe[i].detach().cpu(), pg[i].detach());
    total += pg[i].numel();
    const auto ta = tensors_of(static_cast<State&>(*e.state()[pe[i].unsafeGetTensorImpl()]));
    const auto tb = tensors_of(static_cast<State&>(*g.state()[pg[i].unsafeGetTensorImpl()]));
    for (size_t k = 0; k < ta.size(); ++k) {
      const int64_t d = differing(ta[k].defined() ? ta[k].cpu() : ta[k], tb[k]);
      diff += d < 0 ? 1 : d;
      total += ta[k].defined() ? ta[k].numel() : 0;
    }
  }
  ok = diff == 0 && counts_ok;
  std::printf("  C++ %-44s %s; step counts %s\n", name.c_str(),
              diff == 0 ? "bitwise equal" : (std::to_string(diff) + " of " + std::to_string(total) + " differ").c_str(),
              counts_ok ? "caught up" : "WRONG");
  return ok;
}

// Steps captured without a warm-up are refused with what to do, and change nothing: a fresh
// optimizer's (its state would be made inside the capture), then, after torch::load, one whose
// state has no device work list yet (the launch is refused: no step counted). Eager steps after
// each equal those of an optimizer that never saw a capture.
template <class Opt, class Options, class State>
bool capture_refusal_case(const std::string& name) {
  const at::Device dev(at::kCUDA, 0);
  auto pa = make_params(at::kFloat, dev), pr = make_params(at::kFloat, dev);
  Opt a(pa, Options(1e-2)), ref(pr, Options(1e-2));
  at::manual_seed(500);
  for (size_t i = 0; i < pa.size(); ++i) {
    pa[i].mutable_grad() = (at::randn(pa[i].sizes()) * 1e-2).to(dev);
    pr[i].mutable_grad() = pa[i].grad().clone();
  }
  const at::cuda::CUDAStream side = at::cuda::getStreamFromPool();
  const c10::cuda::CUDAStreamGuard guard(side);
  auto captured_step = [&](Opt& o) {
    side.synchronize();
    at::cuda::CUDAGraph graph;
    graph.capture_begin();
    std::string message;
    try {
      o.step();
    } catch (const c10::Error& e) {
      message = e.what_without_backtrace();
    }
    graph.capture_end();
    return message;
  };
  const std::string fresh = captured_step(a);
  const bool fresh_ok = fresh.find("warm-up") != std::string::npos && a.state().empty();
  a.step();
  ref.step();
  std::stringstream archive;
  torch::save(a, archive);
  Opt b(pa, Options(1e-2));
  torch::load(b, archive);
  const std::string loaded = captured_step(b);
  const auto step_of = [&](Opt& o) { return static_cast<State&>(*o.state()[pa[0].unsafeGetTensorImpl()]).step(); };
  const bool loaded_ok = loaded.find("warm-up") != std::string::npos && step_of(b) == 1 && b.step_count(pa[0]) == 1;
  b.step();
  ref.step();
  side.synchronize();
  int64_t diff = 0;
  for (size_t i = 0; i < pa.size(); ++i) diff += differing(pr[i].detach().cpu(), pa[i].detach());
  const bool counted = step_of(b) == 2 && b.step_count(pa[0]) == 2;
  std::printf("  C++ %-44s fresh: %s; loaded: %s; then eager steps %s, step count %s\n", name.c_str(),
              fresh_ok ? "refused, no state made" : ("WRONG (" + fresh + ")").c_str(),
              loaded_ok ? "refused, no step counted" : ("WRONG (" + loaded + ")").c_str(),
              diff == 0 ? "bitwise equal to a reference" : (std::to_string(diff) + " elements differ").c_str(),
              counted ? "2" : "WRONG");
  return fresh_ok && loaded_ok && diff == 0 && counted;
}
#endif

// Runs one case; an exception (a CUDA error surfaces as a c10::Error) fails that case, is printed,
// and the remaining cases still run: the check gets one shot on a lent GPU.
bool guarded(const std::string& name, const std::function<bool()>& f) {
  try {
    return f();
  } catch (const std::exception& e) {
    std::printf("  C++ %-44s ERROR: %s\n", name.c_str(), e.what());
    return false;
  }
}

}  // namespace

int main() {
  if (!at::hasCUDA()) {
    std::printf("no CUDA device\n");
    return 2;
  }
  std::printf("kernel image: %s\n", optstate::optim::cuda_kernel_image(0).c_str());
  std::printf("== LibTorch optimizers: CUDA params vs CPU params, 4 steps (step count changed and the GPU side saved and loaded after 2)\n");
  bool ok = true;
  const auto dense_state = [](FusedAdamWParamState& s) {
    return std::vector<at::Tensor>{s.exp_avg(), s.exp_avg_sq(), s.max_exp_avg_sq()};
  };
  const auto state8 = [](AdamW8bitParamState& s) {
    std::vector<at::Tensor> out;
    for (const auto* m : {&s.exp_avg(), &s.exp_avg_sq(), &s.max_exp_avg_sq()})
      for (const at::Tensor* t : {&m->codes, &m->absmax, &m->values}) out.push_back(*t);
    return out;
  };
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16})
    for (bool amsgrad : {false, true}) {
      const std::string tag = std::string(dtype == at::kFloat ? "float32" : "bfloat16") + (amsgrad ? " amsgrad" : "");
      const auto make32 = [&](std::vector<at::Tensor> ps) {
        return FusedAdamW(std::move(ps), FusedAdamWOptions(1e-2).weight_decay(0.1).amsgrad(amsgrad));
      };
      const auto make8 = [&](std::vector<at::Tensor> ps) {
        return AdamW8bit(std::move(ps), AdamW8bitOptions(1e-2).weight_decay(0.1).amsgrad(amsgrad));
      };
      ok &= guarded("FusedAdamW " + tag, [&] {
        return run_case<FusedAdamW, FusedAdamWParamState>("FusedAdamW " + tag, dtype, make32, dense_state);
      });
      ok &= guarded("AdamW8bit " + tag, [&] {
        return run_case<AdamW8bit, AdamW8bitParamState>("AdamW8bit " + tag, dtype, make8, state8);
      });
    }
  {
    const auto make32 = [](std::vector<at::Tensor> ps) { return FusedAdamW(std::move(ps), FusedAdamWOptions(1e-2)); };
    const auto make8 = [](std::vector<at::Tensor> ps) { return AdamW8bit(std::move(ps), AdamW8bitOptions(1e-2)); };
    ok &= guarded("FusedAdamW transposed", [&] {
      return run_case<FusedAdamW, FusedAdamWParamState>("FusedAdamW float32, 2-d params transposed", at::kFloat,
                                                        make32, dense_state, true);
    });
    ok &= guarded("AdamW8bit transposed", [&] {
      return run_case<AdamW8bit, AdamW8bitParamState>("AdamW8bit float32, 2-d params transposed", at::kFloat, make8,
                                                       state8, true);
    });
  }
  std::printf("== Step scalars (bias corrections): the kernels' on the device vs the CPU kernels'\n");
  ok &= guarded("step scalars", step_scalars_case);
#if defined(OPTSTATE_CXX_CUDA_GRAPHS)
  std::printf("== LibTorch optimizers: a captured step, lr_tensor on the GPU changed before 3 replays\n");
  ok &= guarded("FusedAdamW graph replays", [] {
    return graph_case<FusedAdamW, FusedAdamWOptions, FusedAdamWParamState>(
        "FusedAdamW graph replays follow set_lr",
        [](FusedAdamWParamState& s) { return std::vector<at::Tensor>{s.exp_avg(), s.exp_avg_sq()}; });
  });
  ok &= guarded("AdamW8bit graph replays", [] {
    return graph_case<AdamW8bit, AdamW8bitOptions, AdamW8bitParamState>(
        "AdamW8bit graph replays follow set_lr", [](AdamW8bitParamState& s) {
          std::vector<at::Tensor> out;
          for (const auto* m : {&s.exp_avg(), &s.exp_avg_sq()})
            for (const at::Tensor* t : {&m->codes, &m->absmax, &m->values}) out.push_back(*t);
          return out;
        });
  });
  std::printf("== LibTorch optimizers: a step captured without a warm-up\n");
  ok &= guarded("FusedAdamW capture refused", [] {
    return capture_refusal_case<FusedAdamW, FusedAdamWOptions, FusedAdamWParamState>("FusedAdamW capture refused");
  });
  ok &= guarded("AdamW8bit capture refused", [] {
    return capture_refusal_case<AdamW8bit, AdamW8bitOptions, AdamW8bitParamState>("AdamW8bit capture refused");
  });
#endif
  return ok ? 0 : 1;
}
