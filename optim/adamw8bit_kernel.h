// The AdamW8bit update: one pass per quantization block that dequantizes exp_avg and exp_avg_sq,
// applies the AdamW update in fp32 with torchao's AdamW8bit arithmetic, writes the param, and
// requantizes the updated moments with their new block absmax. Parameters below the 8-bit size
// threshold run the same arithmetic on dense fp32 state. LibTorch-free interface.
#pragma once

#include <cstdint>
#include <span>

#include "adamw_kernel.h"
#include "optstate/quant8.h"

namespace optstate::optim {

// fp32 scalars of one step, computed as torchao computes them from its float32 `lr` and `step`
// tensors and Python-float betas/eps/weight_decay.
struct AdamW8bitScalars {
  float lr, lr_wd;         // lr; lr * weight_decay
  float w1, w2;            // 1 - beta1, 1 - beta2 (lerp weights)
  float bc1, bc2_sqrt;     // 1 - beta1^t, sqrt(1 - beta2^t), in fp32
  float eps;
  bool amsgrad;
};

AdamW8bitScalars adamw8bit_step_scalars(const AdamWHyper& h, float step);

struct AdamW8bitTensor {
  void* param;       // fp32 or bf16, contiguous
  const void* grad;  // same dtype
  ParamKind kind;
  int64_t numel;
  int64_t block;     // 0: dense fp32 state below
  // blockwise8 state (block > 0): codes one per element, absmax one per block
  uint8_t *m_codes, *v_codes, *vmax_codes;
  float *m_absmax, *v_absmax, *vmax_absmax;
  // dense fp32 state (block == 0)
  float *m, *v, *vmax;
  AdamW8bitScalars s;
};

void adamw8bit_cpu(std::span<const AdamW8bitTensor> items, CpuIsa isa = CpuIsa::kAuto);

// out[i] = a[i] / b, torch's correctly rounded division, as the step divides by its bias corrections
// (on AVX-512 without the divider where it can: adamw8bit_kernel_impl.inc), exposed for the tests.
void divide_by_scalar_cpu(std::span<const float> a, float b, std::span<float> out, CpuIsa isa = CpuIsa::kAuto);

// The path kAuto takes here: "avx512", "avx512-gather", "avx2+fma" or "generic" (all give the same bits).
const char* adamw8bit_cpu_isa();

// codes[i] = the code of x[i] / scale with the kernel's own division and quantizer: the step's
// requantization (whose scale is its block's max |x|, clipped to 1e-12), exposed so tests can hold
// each ISA's path to the reference.
void quantize_scaled_cpu(std::span<const float> x, QMap m, std::span<uint8_t> codes, CpuIsa isa = CpuIsa::kAuto,
                         float scale = 1.0f);

}  // namespace optstate::optim
