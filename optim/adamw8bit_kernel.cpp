#include "adamw8bit_kernel.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iterator>
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
void update8_gather(const AdamW8bitTensor& t, int64_t begin, int64_t end);
void quantize_scaled(const float* x, int64_t n, QMap m, uint8_t* codes, float scale);
void quantize_scaled_gather(const float* x, int64_t n, QMap m, uint8_t* codes, float scale);
void divide_by_scalar(const float* a, int64_t n, float b, float* out);
}
namespace generic {
void update8(const AdamW8bitTensor& t, int64_t begin, int64_t end);
void quantize_scaled(const float* x, int64_t n, QMap m, uint8_t* codes, float scale);
void divide_by_scalar(const float* a, int64_t n, float b, float* out);
}

namespace {
// One code path of the 8-bit kernel: its functions, the name OPTSTATE_CPU_ISA gives it, and the
// name adamw8bit_cpu_isa shows for it.
struct Path {
  CpuIsa isa;
  const char* env_name;
  const char* shown;
  void (*update8)(const AdamW8bitTensor& t, int64_t begin, int64_t end);
  void (*quantize_scaled)(const float* x, int64_t n, QMap m, uint8_t* codes, float scale);
  void (*divide_by_scalar)(const float* a, int64_t n, float b, float* out);
};

// The gather quantizer and the permute one share the AVX-512 division.
constexpr Path kPaths[] = {
    {CpuIsa::kAvx512, "avx512", "avx512", avx512::update8, avx512::quantize_scaled, avx512::divide_by_scalar},
    {CpuIsa::kAvx512Gather, "avx512-gather", "avx512-gather", avx512::update8_gather, avx512::quantize_scaled_gather,
     avx512::divide_by_scalar},
    {CpuIsa::kAvx2, "avx2", "avx2+fma", avx2::update8, avx2::quantize_scaled, avx2::divide_by_scalar},
    {CpuIsa::kGeneric, "generic", "generic", generic::update8, generic::quantize_scaled, generic::divide_by_scalar},
};

const Path& path_of(CpuIsa isa) {
  for (const Path& p : kPaths)
    if (p.isa == isa) return p;
  return kPaths[std::size(kPaths) - 1];  // kAuto never gets here (resolve)
}

// The widest path this CPU runs, or one named by OPTSTATE_CPU_ISA (generic, avx2, avx512,
// avx512-gather; as ATEN_CPU_CAPABILITY does for ATen): for benchmarks that compare the paths in one
// program, and for a machine where a wide path is slower. A path the CPU lacks, or an unknown name,
// is ignored. Of the two AVX-512 paths, AMD CPUs get the byte-permute quantizer (on Zen 4 a 16-lane
// gather is slow: docs/cpu.md) and others the gathers (measured faster than AVX2 on an Intel Xeon;
// the permute one was not measured there).
CpuIsa best_isa() {
  static const CpuIsa kBest = [] {
    __builtin_cpu_init();
    CpuIsa best = !cpu_has(CpuIsa::kAvx512)     ? (cpu_has(CpuIsa::kAvx2) ? CpuIsa::kAvx2 : CpuIsa::kGeneric)
                  : __builtin_cpu_is("amd") ? CpuIsa::kAvx512
                                            : CpuIsa::kAvx512Gather;
    const char* want = std::getenv("OPTSTATE_CPU_ISA");
    const std::string_view w = want ? want : "";
    for (const Path& p : kPaths)
      if (w == p.env_name && cpu_has(p.isa)) best = p.isa;
    return best;
  }();
  return kBest;
}

const Path& resolve(CpuIsa isa) { return path_of(isa == CpuIsa::kAuto ? best_isa() : isa); }

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
  const auto fn = resolve(isa).update8;
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
  resolve(isa).quantize_scaled(x.data(), static_cast<int64_t>(x.size()), m, codes.data(), scale);
}

void divide_by_scalar_cpu(std::span<const float> a, float b, std::span<float> out, CpuIsa isa) {
  resolve(isa).divide_by_scalar(a.data(), static_cast<int64_t>(a.size()), b, out.data());
}

const char* adamw8bit_cpu_isa() { return path_of(best_isa()).shown; }

}  // namespace optstate::optim
