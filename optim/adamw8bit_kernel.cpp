#include "adamw8bit_kernel.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string_view>
#include <vector>

namespace optstate::optim {
namespace avx2 {
void update8(const AdamW8bitTensor& t, int64_t begin, int64_t end);
void quantize_scaled(const float* x, int64_t n, QMap m, uint8_t* codes, float scale);
void divide_by_scalar(const float* a, int64_t n, float b, float* out);
}
namespace avx512 {
void update8(const AdamW8bitTensor& t, int64_t begin, int64_t end);
void quantize_scaled(const float* x, int64_t n, QMap m, uint8_t* codes, float scale);
void divide_by_scalar(const float* a, int64_t n, float b, float* out);
}
namespace generic {
void update8(const AdamW8bitTensor& t, int64_t begin, int64_t end);
void quantize_scaled(const float* x, int64_t n, QMap m, uint8_t* codes, float scale);
void divide_by_scalar(const float* a, int64_t n, float b, float* out);
}

namespace {
// The widest path this CPU runs, or a narrower one named by OPTSTATE_CPU_ISA (generic, avx2, avx512;
// as ATEN_CPU_CAPABILITY does for ATen): for benchmarks that compare the paths in one program, and
// for a machine where a wide path is slower. A name wider than the CPU runs, or unknown, is ignored.
CpuIsa best_isa() {
  static const CpuIsa kBest = [] {
    CpuIsa best = cpu_has(CpuIsa::kAvx512) ? CpuIsa::kAvx512 : cpu_has(CpuIsa::kAvx2) ? CpuIsa::kAvx2 : CpuIsa::kGeneric;
    const char* want = std::getenv("OPTSTATE_CPU_ISA");
    const std::string_view w = want ? want : "";
    if (w == "generic") best = CpuIsa::kGeneric;
    if (w == "avx2" && best == CpuIsa::kAvx512) best = CpuIsa::kAvx2;
    return best;
  }();
  return kBest;
}

CpuIsa resolve(CpuIsa isa) { return isa == CpuIsa::kAuto ? best_isa() : isa; }

// beta^step in fp32 as the double power rounded once: the correctly rounded powf (barring a double
// rounding, which no step of the usual betas meets), and what the CUDA kernels compute. Not
// std::pow(float, float): glibc's powf (torch's CPU pow, so torchao's CPU step) is within 0.82 ulp,
// not correctly rounded, and no device function reproduces its misroundings (docs/numerics.md).
float pow_f32(float base, float step) {
  return static_cast<float>(std::pow(static_cast<double>(base), static_cast<double>(step)));
}

}  // namespace

AdamW8bitScalars adamw8bit_step_scalars(const AdamWHyper& h, float step) {
  // torchao keeps lr and step as float32 tensors: every product below rounds in fp32.
  AdamW8bitScalars s;
  s.lr = static_cast<float>(h.lr);
  s.lr_wd = s.lr * static_cast<float>(h.weight_decay);
  s.w1 = static_cast<float>(1.0 - h.beta1);
  s.w2 = static_cast<float>(1.0 - h.beta2);
  s.bc1 = 1.0f - pow_f32(static_cast<float>(h.beta1), step);
  s.bc2_sqrt = std::sqrt(1.0f - pow_f32(static_cast<float>(h.beta2), step));
  s.eps = static_cast<float>(h.eps);
  s.amsgrad = h.amsgrad;
  return s;
}

void adamw8bit_cpu(std::span<const AdamW8bitTensor> items, CpuIsa isa) {
  using Fn = void (*)(const AdamW8bitTensor&, int64_t, int64_t);
  const CpuIsa use = resolve(isa);
  const Fn fn = use == CpuIsa::kAvx512 ? avx512::update8 : use == CpuIsa::kAvx2 ? avx2::update8 : generic::update8;
  // Work list of block-aligned chunks of about 16 Ki elements over all tensors; one parallel region.
  struct Work {
    size_t t;
    int64_t begin, end;
  };
  std::vector<Work> work;
  for (size_t i = 0; i < items.size(); ++i) {
    const int64_t unit = items[i].block > 0 ? items[i].block : 1;
    const int64_t chunk = std::max<int64_t>(1, 16384 / unit) * unit;
    for (int64_t b = 0; b < items[i].numel; b += chunk) work.push_back({i, b, std::min(items[i].numel, b + chunk)});
  }
  if (work.empty()) return;
  at::parallel_for(0, static_cast<int64_t>(work.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t w = lo; w < hi; ++w) fn(items[work[w].t], work[w].begin, work[w].end);
  });
}

void quantize_scaled_cpu(std::span<const float> x, QMap m, std::span<uint8_t> codes, CpuIsa isa, float scale) {
  const CpuIsa use = resolve(isa);
  (use == CpuIsa::kAvx512 ? avx512::quantize_scaled
   : use == CpuIsa::kAvx2 ? avx2::quantize_scaled
                          : generic::quantize_scaled)(x.data(), static_cast<int64_t>(x.size()), m, codes.data(), scale);
}

void divide_by_scalar_cpu(std::span<const float> a, float b, std::span<float> out, CpuIsa isa) {
  const CpuIsa use = resolve(isa);
  (use == CpuIsa::kAvx512 ? avx512::divide_by_scalar
   : use == CpuIsa::kAvx2 ? avx2::divide_by_scalar
                          : generic::divide_by_scalar)(a.data(), static_cast<int64_t>(a.size()), b, out.data());
}

const char* adamw8bit_cpu_isa() {
  const CpuIsa use = best_isa();
  return use == CpuIsa::kAvx512 ? "avx512" : use == CpuIsa::kAvx2 ? "avx2+fma" : "generic";
}

}  // namespace optstate::optim
