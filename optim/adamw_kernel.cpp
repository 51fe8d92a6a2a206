#include "adamw_kernel.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace optstate::optim {
namespace avx2 {
void update(const AdamWTensor& t, int64_t begin, int64_t end);
}
namespace generic {
void update(const AdamWTensor& t, int64_t begin, int64_t end);
}

namespace {
// 16 Ki elements: 64 KiB per fp32 stream, so a chunk's 4-5 streams stay in L2 while it is updated.
constexpr int64_t kChunk = 16384;

using UpdateFn = void (*)(const AdamWTensor&, int64_t, int64_t);

UpdateFn pick_update() { return cpu_has(CpuIsa::kAvx2) ? avx2::update : generic::update; }
const UpdateFn kUpdate = pick_update();
}  // namespace

bool cpu_has(CpuIsa isa) {
  __builtin_cpu_init();  // the CPUID and XGETBV probe: a feature counts only where the OS saves its registers
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  switch (isa) {
    case CpuIsa::kAvx2:
      return avx2;
    case CpuIsa::kAvx512:
    case CpuIsa::kAvx512Gather:
      return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512vbmi");
    default:
      return true;
  }
}

const char* adamw_cpu_isa() { return kUpdate == avx2::update ? "avx2+fma" : "generic"; }

AdamWStepScalars adamw_step_scalars(const AdamWHyper& h, int64_t step) {
  // Python-float (double) arithmetic as in torch.optim.adamw._single_tensor_adamw, rounded to fp32 once.
  const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(step));
  AdamWStepScalars s;
  s.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  s.lerp_weight = static_cast<float>(1.0 - h.beta1);
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_b2 = static_cast<float>(1.0 - h.beta2);
  s.neg_step_size = static_cast<float>(-(h.lr / bc1));
  s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  s.eps = static_cast<float>(h.eps);
  s.amsgrad = h.amsgrad;
  s.maximize = h.maximize;
  return s;
}

void adamw_cpu(std::span<const AdamWTensor> items, CpuIsa isa) {
  const UpdateFn update = isa == CpuIsa::kAuto                              ? kUpdate
                         : isa != CpuIsa::kGeneric ? avx2::update  // the AVX-512 ones included
                                                   : generic::update;
  // Work list over all tensors: (tensor, first chunk). One parallel region for the whole step.
  std::vector<int64_t> first_chunk(items.size() + 1, 0);
  for (size_t i = 0; i < items.size(); ++i)
    first_chunk[i + 1] = first_chunk[i] + (items[i].numel + kChunk - 1) / kChunk;
  const int64_t total = first_chunk.back();
  if (total == 0) return;
  at::parallel_for(0, total, 1, [&](int64_t begin, int64_t end) {
    size_t t = static_cast<size_t>(std::upper_bound(first_chunk.begin(), first_chunk.end(), begin) -
                                   first_chunk.begin() - 1);
    for (int64_t c = begin; c < end; ++c) {
      while (c >= first_chunk[t + 1]) ++t;
      const int64_t lo = (c - first_chunk[t]) * kChunk;
      const int64_t hi = std::min(items[t].numel, lo + kChunk);
      update(items[t], lo, hi);
    }
  });
}

}  // namespace optstate::optim
