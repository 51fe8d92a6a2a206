// The fused AdamW element update, shared by the LibTorch optimizer and the torch ops: one pass over
// param, grad, exp_avg, exp_avg_sq (and max_exp_avg_sq) per element, all tensors in one parallel
// launch. LibTorch-free interface: plain pointers and precomputed per-tensor scalars.
#pragma once

#include <cstdint>
#include <span>

namespace optstate::optim {

enum class ParamKind : uint8_t { kF32, kBF16 };

struct AdamWHyper {
  double lr, beta1, beta2, eps, weight_decay;
  bool amsgrad, maximize;
};

// Per-tensor constants of one step, rounded to fp32 exactly as torch.optim.AdamW rounds its Python
// floats when it applies them to fp32 tensors (so the for-loop reference can be matched).
struct AdamWStepScalars {
  float decay;          // 1 - lr * weight_decay
  float lerp_weight;    // 1 - beta1
  float beta2;          // beta2
  float one_minus_b2;   // 1 - beta2
  float neg_step_size;  // -lr / (1 - beta1^step)
  float bc2_sqrt;       // sqrt(1 - beta2^step)
  float eps;
  bool amsgrad, maximize;
};

AdamWStepScalars adamw_step_scalars(const AdamWHyper& h, int64_t step);

struct AdamWTensor {
  void* param;           // fp32 or bf16, contiguous
  const void* grad;      // same dtype as param
  float* exp_avg;        // fp32 state, contiguous
  float* exp_avg_sq;
  float* max_exp_avg_sq;  // only with amsgrad
  int64_t numel;
  ParamKind kind;
  AdamWStepScalars s;
};

// kAvx512 (F, BW, DQ, VL, VBMI, with AVX2+FMA) has its own paths in the 8-bit kernel only: kAvx512
// quantizes with byte permutes, kAvx512Gather with gathers (same ISA, same bits; which is faster
// depends on the CPU's gathers). The fp32 kernel, bound by memory, runs its AVX2 path for both.
enum class CpuIsa : uint8_t { kAuto, kGeneric, kAvx2, kAvx512, kAvx512Gather };

// Whether this CPU (and its OS) runs the code paths of `isa` (kAuto and kGeneric: always).
bool cpu_has(CpuIsa isa);

// Updates every tensor in `items` (one parallel region over fixed-size chunks of all of them).
// `isa` forces a code path (tests check that all give the same bits); the CPU must have it.
void adamw_cpu(std::span<const AdamWTensor> items, CpuIsa isa = CpuIsa::kAuto);

// Which ISA the CPU kernels dispatch to: "avx2+fma" or "generic" for the fp32 kernel; the 8-bit
// kernel's (adamw8bit_cpu_isa, adamw8bit_kernel.h) may be "avx512" where this is "avx2+fma".
const char* adamw_cpu_isa();

}  // namespace optstate::optim
