// CPU optimizer kernels side by side in one process, interleaved round by round so a noisy machine
// (a shared VM whose speed drifts over seconds) hits every candidate alike: optstate's FusedAdamW
// and AdamW8bit kernels (their AVX-512 (8-bit only), AVX2 and generic paths) and torch's own fused CPU AdamW
// (at::_fused_adamw_, what torch.optim.AdamW(fused=True) runs), on the same fp32 tensor. Prints the
// best and median ms per step, ns per element per thread, and GB/s at the bytes each must move (28
// per param for fp32 state, 16 for 8-bit), next to the copy bandwidth measured in the same run.
//
//   build/bench/optstate_bench_kernels [--numel N] [--threads T] [--rounds R] [--only TEXT]
//
// --only keeps the candidates whose name contains TEXT (plus copy and torch, the references).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "adamw8bit_kernel.h"
#include "adamw_kernel.h"
#include "optstate/quant8.h"

using namespace optstate;
using namespace optstate::optim;

namespace {

struct Candidate {
  std::string name;
  double bytes_per_param;
  std::function<void()> step;
  std::vector<double> ms;
};

double time_ms(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  int64_t n = int64_t{1} << 24;
  int threads = at::get_num_threads(), rounds = 15;
  std::string only;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--numel")) n = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--threads")) threads = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--rounds")) rounds = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--only")) only = argv[i + 1];
    else {
      std::fprintf(stderr, "usage: %s [--numel N] [--threads T] [--rounds R] [--only TEXT]\n", argv[0]);
      return 2;
    }
  }
  at::set_num_threads(threads);
  at::manual_seed(0);
  const at::Tensor p0 = at::randn({n}), g = at::randn({n}) * 1e-2;
  const AdamWHyper h{1e-3, 0.9, 0.999, 1e-8, 1e-2, false, false};

  // fp32 state for the AdamW candidates; each gets its own copy of the param and moments.
  struct Dense {
    at::Tensor p, m, v;
  };
  auto dense = [&] { return Dense{p0.clone(), at::zeros({n}), at::zeros({n})}; };
  Dense ours_avx2 = dense(), ours_generic = dense(), torch_fused = dense();
  auto adamw_item = [&](Dense& d) {
    return AdamWTensor{d.p.data_ptr(), g.data_ptr(), d.m.data_ptr<float>(), d.v.data_ptr<float>(), nullptr, n,
                       ParamKind::kF32, adamw_step_scalars(h, 10)};
  };
  const at::Tensor torch_step = at::full({}, 10.0);

  // 8-bit state: quantized moments of a few steps' worth of gradients.
  struct Quant {
    at::Tensor p;
    std::vector<uint8_t> mc, vc;
    std::vector<float> ma, va;
  };
  const int64_t block = 256, nb = (n + block - 1) / block;
  auto quant = [&] {
    Quant q{p0.clone(), std::vector<uint8_t>(n), std::vector<uint8_t>(n), std::vector<float>(nb),
            std::vector<float>(nb)};
    const at::Tensor m = g * 0.3, v = g * g * 1e-2;
    quantize_blockwise({m.data_ptr<float>(), static_cast<size_t>(n)}, block, QMap::kDynamicSigned, q.mc, q.ma);
    quantize_blockwise({v.data_ptr<float>(), static_cast<size_t>(n)}, block, QMap::kDynamicUnsigned, q.vc, q.va);
    return q;
  };
  Quant q_avx512 = quant(), q_avx512_gather = quant(), q_avx2 = quant(), q_generic = quant();
  auto item8 = [&](Quant& q) {
    AdamW8bitTensor t{};
    t.param = q.p.data_ptr();
    t.grad = g.data_ptr();
    t.kind = ParamKind::kF32;
    t.numel = n;
    t.block = block;
    t.m_codes = q.mc.data();
    t.v_codes = q.vc.data();
    t.m_absmax = q.ma.data();
    t.v_absmax = q.va.data();
    t.s = adamw8bit_step_scalars(h, 10.0f);
    return t;
  };

  std::vector<Candidate> cands;
  cands.push_back({"copy (reference bandwidth)", 8, [&, dst = at::empty({n})]() mutable { dst.copy_(p0); }, {}});
  cands.push_back({"torch _fused_adamw_", 28, [&] {
                     at::_fused_adamw_({torch_fused.p}, {g}, {torch_fused.m}, {torch_fused.v}, {}, {torch_step}, h.lr,
                                       h.beta1, h.beta2, h.weight_decay, h.eps, false, false);
                   }, {}});
  std::vector<std::pair<CpuIsa, const char*>> isas;
  if (cpu_has(CpuIsa::kAvx512)) isas.push_back({CpuIsa::kAvx512, "avx512"});
  if (cpu_has(CpuIsa::kAvx512Gather)) isas.push_back({CpuIsa::kAvx512Gather, "avx512-gather"});
  if (cpu_has(CpuIsa::kAvx2)) isas.push_back({CpuIsa::kAvx2, "avx2"});
  isas.push_back({CpuIsa::kGeneric, "generic"});
  for (const auto& [isa, tag] : isas) {
    Dense& d = isa == CpuIsa::kAvx2 ? ours_avx2 : ours_generic;
    Quant& q = isa == CpuIsa::kAvx512         ? q_avx512
               : isa == CpuIsa::kAvx512Gather ? q_avx512_gather
               : isa == CpuIsa::kAvx2         ? q_avx2
                                              : q_generic;
    if (isa == CpuIsa::kAvx2 || isa == CpuIsa::kGeneric)  // the fp32 kernel has no AVX-512 path of its own
      cands.push_back({std::string("optstate FusedAdamW ") + tag, 28, [&, isa = isa, dp = &d] {
                         const AdamWTensor t = adamw_item(*dp);
                         adamw_cpu({&t, 1}, isa);
                       }, {}});
    cands.push_back({std::string("optstate AdamW8bit ") + tag, 16, [&, isa = isa, qp = &q] {
                       const AdamW8bitTensor t = item8(*qp);
                       adamw8bit_cpu({&t, 1}, isa);
                     }, {}});
  }

  if (!only.empty())
    std::erase_if(cands, [&](const Candidate& c) {
      return c.name.find(only) == std::string::npos && c.name.rfind("copy", 0) != 0 && c.name.rfind("torch", 0) != 0;
    });
  for (auto& c : cands) c.step();  // warm-up: page faults, thread pool
  for (int r = 0; r < rounds; ++r)
    for (auto& c : cands) c.ms.push_back(time_ms(c.step));

  std::printf("%lld fp32 params, %d thread(s), %d interleaved rounds\n", static_cast<long long>(n), threads, rounds);
  std::printf("%-33s %9s %9s %12s %8s %10s\n", "kernel", "best ms", "median ms", "ns/elem/thr", "GB/s", "vs torch");
  double torch_best = 0;
  for (auto& c : cands) {
    std::sort(c.ms.begin(), c.ms.end());
    if (c.name == "torch _fused_adamw_") torch_best = c.ms.front();
  }
  for (const auto& c : cands) {
    const double best = c.ms.front(), median = c.ms[c.ms.size() / 2];
    const double gbps = c.bytes_per_param * static_cast<double>(n) / (best * 1e6);
    std::printf("%-33s %9.2f %9.2f %12.2f %8.1f %9.2fx\n", c.name.c_str(), best, median,
                best * 1e6 / static_cast<double>(n) * threads, gbps, best / torch_best);
  }
  return 0;
}
