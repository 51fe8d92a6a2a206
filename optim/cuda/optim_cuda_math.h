// The element math of the CUDA kernels, compiled for the device by optim_cuda.cu and for the host
// by the CPU test that checks it bit for bit against the CPU kernels (tests/optim/test_cuda_math.cpp),
// so the operation order is proven equal on any machine, GPU or not. Plain C math names (fmaf,
// sqrtf, pow) resolve to IEEE host libm and CUDA device functions alike; NaN tests are x != x.
#pragma once

#include <cstdint>
#include <cstring>

#include "optim_cuda.h"

#if defined(__CUDACC__)
#define OPTSTATE_HD __host__ __device__ __forceinline__
#else
#include <cmath>
#define OPTSTATE_HD inline
#endif

namespace optstate::optim::cuda::math {

OPTSTATE_HD float bits_float(uint32_t b) {
  float f;
  memcpy(&f, &b, 4);
  return f;
}
OPTSTATE_HD uint32_t float_bits(float f) {
  uint32_t b;
  memcpy(&b, &f, 4);
  return b;
}

OPTSTATE_HD float load_value(const void* base, int64_t i, Param k) {
  if (k == Param::kF32) return static_cast<const float*>(base)[i];
  return bits_float(static_cast<uint32_t>(static_cast<const uint16_t*>(base)[i]) << 16);
}

OPTSTATE_HD void store_value(void* base, int64_t i, float v, Param k) {
  if (k == Param::kF32) {
    static_cast<float*>(base)[i] = v;
    return;
  }
  const uint32_t bits = float_bits(v);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  static_cast<uint16_t*>(base)[i] = v != v ? uint16_t{0x7fc0} : static_cast<uint16_t>(rounded);
}

// torch.lerp with a scalar weight: one FMA, the form picked by |w| < 0.5.
OPTSTATE_HD float lerp(float a, float b, float w, bool small) {
  return small ? fmaf(w, b - a, a) : fmaf(w - 1.0f, b - a, b);
}

struct AdamWScalars {
  float decay, lerp_weight, beta2, one_minus_b2, neg_step_size, bc2_sqrt, eps;
  bool amsgrad, maximize, small;
};

// adamw_step_scalars: Python-float (double) arithmetic rounded to fp32 once.
OPTSTATE_HD AdamWScalars adamw_scalars(const Hyper& h, float step) {
  const double t = static_cast<double>(step);
  const double bc1 = 1.0 - pow(h.beta1, t);
  const double bc2 = 1.0 - pow(h.beta2, t);
  AdamWScalars s;
  s.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  s.lerp_weight = static_cast<float>(1.0 - h.beta1);
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_b2 = static_cast<float>(1.0 - h.beta2);
  s.neg_step_size = static_cast<float>(-(h.lr / bc1));
  s.bc2_sqrt = static_cast<float>(sqrt(bc2));
  s.eps = static_cast<float>(h.eps);
  s.amsgrad = h.amsgrad != 0;
  s.maximize = h.maximize != 0;
  s.small = fabsf(s.lerp_weight) < 0.5f;
  return s;
}

OPTSTATE_HD void adamw_element(const AdamWScalars& s, float& p, float g, float& m, float& v, float* mx) {
  if (s.maximize) g = -g;
  const float pv = p * s.decay;
  const float mv = lerp(m, g, s.lerp_weight, s.small);
  float vv = v * s.beta2;
  vv = fmaf(s.one_minus_b2 * g, g, vv);
  float vden = vv;
  if (s.amsgrad) {
    const float old = *mx;
    vden = (old > vv || old != old) ? old : vv;
    *mx = vden;
  }
  const float denom = sqrtf(vden) / s.bc2_sqrt + s.eps;
  p = pv + (s.neg_step_size * mv) / denom;
  m = mv;
  v = vv;
}

// Quantization divides every moment of a block by the block's scale d. With r = RN(1/d) once per
// block, y = RN(x * r) and one correction q = RN(y + r * (x - d * y)) (the residual exact by the fma)
// is the correctly rounded x / d while nothing underflows: the sequence CUDA's own IEEE division runs
// after its range check (FCHK), with r already the best reciprocal (Markstein). Here |x| <= d (d is
// the block's max |x|, clipped to >= 1e-12 > 2^-40) and d <= 2^45 (checked once per block:
// Recip::ok). Where the code depends on the quotient's value (|q| >= 2^-24, outside the
// quantizer's bucket of tiny magnitudes) |x| >= 2^-64 and every step is exact; a smaller quotient,
// however rounded, keeps x's sign and stays in that bucket, so it gets the division's code. ~3
// instructions instead of ~10 (reciprocal, range check); the host test checks both claims.
struct Recip {
  float d, r;
  bool ok;  // 2^-45 <= d <= 2^45: the fast quotient is exact where it matters
};

OPTSTATE_HD Recip recip(float d) {
  Recip k;
  k.d = d;
  k.r = 1.0f / d;
  k.ok = d >= 0x1p-45f && d <= 0x1p45f;
  return k;
}

OPTSTATE_HD float div_fast(float x, const Recip& k) {
  const float y = x * k.r;
  const float e = fmaf(-y, k.d, x);
  return fmaf(e, k.r, y);
}

struct Scalars8 {
  float lr, lr_wd, w1, w2, bc1, bc2_sqrt, eps;
  bool amsgrad, small1, small2;
};

// adamw8bit_step_scalars: torchao's float32 lr/step tensors; fp32 products. beta^step is the double
// pow rounded once to fp32, as on the CPU (adamw8bit_kernel.cpp: pow_f32, and why not powf).
OPTSTATE_HD Scalars8 scalars8(const Hyper& h, float step) {
  Scalars8 s;
  s.lr = static_cast<float>(h.lr);
  s.lr_wd = s.lr * static_cast<float>(h.weight_decay);
  s.w1 = static_cast<float>(1.0 - h.beta1);
  s.w2 = static_cast<float>(1.0 - h.beta2);
  s.bc1 = 1.0f - static_cast<float>(pow(static_cast<double>(static_cast<float>(h.beta1)), static_cast<double>(step)));
  s.bc2_sqrt =
      sqrtf(1.0f - static_cast<float>(pow(static_cast<double>(static_cast<float>(h.beta2)), static_cast<double>(step))));
  s.eps = static_cast<float>(h.eps);
  s.amsgrad = h.amsgrad != 0;
  s.small1 = fabsf(s.w1) < 0.5f;
  s.small2 = fabsf(s.w2) < 0.5f;
  return s;
}

OPTSTATE_HD void update8(const Scalars8& s, float& p, float g, float& m, float& v, float* vmax) {
  p = p - s.lr_wd * p;
  const float mi = lerp(m, g, s.w1, s.small1);
  const float vi = lerp(v, g * g, s.w2, s.small2);
  float vd = vi;
  if (s.amsgrad) {
    const float old = *vmax;
    vd = (old > vi || old != old) ? old : vi;
    *vmax = vd;
  }
  const float denom = sqrtf(vd) / s.bc2_sqrt + s.eps;
  p = p - (s.lr * (mi / s.bc1)) / denom;
  m = mi;
  v = vi;
}

// quantize_scaled_reference: the largest c with map[c] <= x, rounded up at the midpoint (ties up).
OPTSTATE_HD uint8_t quantize(float x, const float* map) {
  int c = x >= map[128] ? 128 : 0;
  for (int half = 64; half >= 1; half /= 2) c += x >= map[c + half] ? half : 0;
  const int up = c + 1 < 255 ? c + 1 : 255;
  const float down_v = map[c], up_v = map[up];
  if (x - down_v >= (up_v - down_v) * 0.5f) c = up;
  return static_cast<uint8_t>(c);
}

// The block scale from the largest |x| bit pattern (NaN patterns sort above inf), clipped to 1e-12.
OPTSTATE_HD float scale_from_bits(uint32_t max_abs_bits) {
  if (max_abs_bits > 0x7f800000u) return bits_float(0x7fc00000u);
  const float f = bits_float(max_abs_bits);
  return f > 1e-12f ? f : 1e-12f;
}

}  // namespace optstate::optim::cuda::math
