#include "optstate/quant8.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace optstate {
namespace {

// torch.linspace(0.1, 1, n) in fp32 as ATen's CPU kernel computes it (scalar loop; built with FMA
// contraction on x86-64, so start + step*i and end - step*(n-1-i) each round once).
std::vector<float> linspace_f32(int n) {
  const float start = 0.1f, end = 1.0f;
  const float step = (end - start) / static_cast<float>(n - 1);
  std::vector<float> out(n);
  const int half = n / 2;
  for (int i = 0; i < n; ++i)
    out[i] = i < half ? std::fma(step, static_cast<float>(i), start)
                      : std::fma(-step, static_cast<float>(n - i - 1), end);
  return out;
}

// bitsandbytes' create_dynamic_map(signed, max_exponent_bits=7, total_bits=8), as torchao restates it:
// for exponent i = 0..6, the midpoints of a linspace over [0.1, 1] scaled by 10^(i-6), mirrored when
// signed; then 0 and 1; sorted. All arithmetic in fp32 as torch does it.
std::array<float, 256> make_dynamic_map(bool is_signed) {
  std::vector<float> data;
  for (int i = 0; i < 7; ++i) {
    const int items = is_signed ? (1 << i) + 1 : (1 << (i + 1)) + 1;
    const std::vector<float> b = linspace_f32(items);
    const float scale = static_cast<float>(std::pow(10.0, i - 6));  // Python 10**(i-6), rounded to fp32
    for (int k = 0; k + 1 < items; ++k) {
      const float mean = (b[k] + b[k + 1]) / 2.0f;
      data.push_back(scale * mean);
      if (is_signed) data.push_back(-scale * mean);
    }
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  std::sort(data.begin(), data.end());
  std::array<float, 256> out{};
  std::copy(data.begin(), data.end(), out.begin());
  return out;
}

}  // namespace

std::string_view qmap_name(QMap m) { return m == QMap::kDynamicSigned ? "dynamic-signed" : "dynamic-unsigned"; }

Result<QMap> qmap_from_name(std::string_view name) {
  if (name == "dynamic-signed") return QMap::kDynamicSigned;
  if (name == "dynamic-unsigned") return QMap::kDynamicUnsigned;
  return unsupported(fmt::format("unknown quantization map '{}'", name));
}

const std::array<float, 256>& qmap_table(QMap m) {
  static const std::array<float, 256> kSigned = make_dynamic_map(true);
  static const std::array<float, 256> kUnsigned = make_dynamic_map(false);
  return m == QMap::kDynamicSigned ? kSigned : kUnsigned;
}

std::optional<QMap> qmap_matching(const std::array<float, 256>& m) {
  for (QMap k : {QMap::kDynamicSigned, QMap::kDynamicUnsigned})
    if (std::memcmp(m.data(), qmap_table(k).data(), sizeof m) == 0) return k;
  return std::nullopt;
}

uint8_t quantize_scaled_reference(float x, const float* map) {
  int c = x >= map[128] ? 128 : 0;
  for (int half = 64; half >= 1; half /= 2) c += x >= map[c + half] ? half : 0;
  const int up = std::min(c + 1, 255);
  const float down_v = map[c], up_v = map[up];
  if (x - down_v >= (up_v - down_v) * 0.5f) c = up;
  return static_cast<uint8_t>(c);
}

namespace {
// Total order of floats as unsigned integers (negative values reversed), NaN excluded.
uint32_t ordered(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
float from_ordered(uint32_t o) {
  const uint32_t b = (o & 0x80000000u) ? (o & 0x7fffffffu) : ~o;
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}
}  // namespace

Quantizer::Quantizer(QMap m) : map_(qmap_table(m).data()) {
  const float inf = std::numeric_limits<float>::infinity();
  // t[c]: the least float (by value) whose reference code exceeds c; binary search on the order.
  const uint32_t lo_all = ordered(-inf), hi_all = ordered(inf);
  for (int c = 0; c < 255; ++c) {
    uint32_t lo = lo_all, hi = hi_all;  // code(from_ordered(hi)) > c is known (inf gives 255)
    while (lo < hi) {
      const uint32_t mid = lo + (hi - lo) / 2;
      if (quantize_scaled_reference(from_ordered(mid), map_) > c)
        hi = mid;
      else
        lo = mid + 1;
    }
    threshold_[c] = from_ordered(lo);
  }
  threshold_[255] = threshold_[256] = inf;

  // Bucket table (quant8_buckets.h). The shared first and last buckets must hold no step: their
  // low bits are not the bucket's own.
  const bool is_signed = map_[0] < 0.0f;
  layout_ = bucket_layout(is_signed);
  const uint32_t low_mask = (1u << layout_.shift) - 1, none = 1u << layout_.shift;
  entry_.assign(bucket_entries(layout_), 0);
  auto value = [](uint32_t sign, uint32_t mag) {
    const uint32_t b = sign << 31 | mag;
    float f;
    std::memcpy(&f, &b, 4);
    return f;
  };
  for (uint32_t sign = 0; sign < (is_signed ? 2u : 1u); ++sign)
    for (uint32_t k = 0; k < layout_.count; ++k) {
      const uint32_t own = (layout_.first + k) << layout_.shift;  // the bucket's own magnitudes
      const uint32_t lo = k == 0 ? 0u : own;
      const uint32_t hi = k + 1 == layout_.count ? 0x7f800000u : own | low_mask;
      const uint8_t base = quantize_scaled_reference(value(sign, lo), map_);
      const uint8_t top = quantize_scaled_reference(value(sign, hi), map_);
      uint32_t step = none;
      if (top != base) {
        // a step in a shared end, or a step of more than one code: the layout cannot be exact
        if (k == 0 || k + 1 == layout_.count || top != (sign ? base - 1 : base + 1)) std::abort();
        uint32_t a = 0, b = low_mask;  // least low bits whose code differs from base
        while (a < b) {
          const uint32_t mid = a + (b - a) / 2;
          if (quantize_scaled_reference(value(sign, own | mid), map_) != base)
            b = mid;
          else
            a = mid + 1;
        }
        step = a;
      }
      // x < 0: the code steps down from base at low bits `step`; bucket_code reads the complemented
      // low bits, in which the code steps up from base - 1 at low_mask - step + 1.
      const uint32_t entry = sign && step != none ? (base - 1u) | (low_mask - step + 1u) << kBucketBaseBits
                                                  : base | step << kBucketBaseBits;
      entry_[sign * layout_.count + k] = entry;
    }
}

const Quantizer& Quantizer::get(QMap m) {
  static const Quantizer kSigned(QMap::kDynamicSigned);
  static const Quantizer kUnsigned(QMap::kDynamicUnsigned);
  return m == QMap::kDynamicSigned ? kSigned : kUnsigned;
}

float block_scale(std::span<const float> x) {
  float m = 0.0f;
  bool nan = false;
  for (float v : x) {
    const float a = std::fabs(v);
    m = a > m ? a : m;
    nan |= std::isnan(v);
  }
  if (nan) return std::numeric_limits<float>::quiet_NaN();  // torch's amax and clip propagate NaN
  return m > kMinAbsmax ? m : kMinAbsmax;
}

void quantize_blockwise(std::span<const float> x, int64_t block, QMap m, std::span<uint8_t> codes,
                        std::span<float> absmax) {
  const Quantizer& q = Quantizer::get(m);
  const size_t n = x.size();
  for (size_t b = 0, start = 0; start < n; ++b, start += static_cast<size_t>(block)) {
    const size_t len = std::min(static_cast<size_t>(block), n - start);
    const float scale = block_scale(x.subspan(start, len));
    absmax[b] = scale;
    for (size_t i = start; i < start + len; ++i) codes[i] = q(x[i] / scale);
  }
}

namespace {

// Quantizes x with `scale` and reports whether dequantizing gives x back bit for bit.
bool quantize_exactly(std::span<const float> x, float scale, const Quantizer& q, uint8_t* codes) {
  for (size_t i = 0; i < x.size(); ++i) {
    codes[i] = q(x[i] / scale);
    const float back = q.map()[codes[i]] * scale;
    if (std::memcmp(&back, &x[i], 4) != 0) return false;
  }
  return true;
}

}  // namespace

int64_t requantize_blockwise(std::span<const float> x, int64_t block, QMap m, std::span<uint8_t> codes,
                             std::span<float> absmax) {
  const Quantizer& q = Quantizer::get(m);
  const float* map = q.map();
  int64_t recovered = 0;
  std::vector<uint8_t> trial(static_cast<size_t>(block));
  const size_t n = x.size();
  for (size_t b = 0, start = 0; start < n; ++b, start += static_cast<size_t>(block)) {
    const size_t len = std::min(static_cast<size_t>(block), n - start);
    const auto xs = x.subspan(start, len);
    const float rule = block_scale(xs);
    // Candidate scales: the rule's (the block's largest value had code 255), and scales near
    // max|x| / |map[0]| (it had code 0, the most negative value of the signed map).
    std::vector<float> candidates{rule};
    if (std::isfinite(rule) && rule > kMinAbsmax && map[0] < 0) {
      const float guess = rule / -map[0];
      float up = guess, down = guess;
      candidates.push_back(guess);
      for (int k = 0; k < 2; ++k) {
        up = std::nextafter(up, std::numeric_limits<float>::infinity());
        down = std::nextafter(down, 0.0f);
        candidates.push_back(up);
        candidates.push_back(down);
      }
    }
    bool done = false;
    for (float s : candidates) {
      if (quantize_exactly(xs, s, q, trial.data())) {
        std::copy(trial.begin(), trial.begin() + static_cast<std::ptrdiff_t>(len), codes.begin() + start);
        absmax[b] = s;
        recovered += (s != rule);
        done = true;
        break;
      }
    }
    if (!done) {
      absmax[b] = rule;
      for (size_t i = 0; i < len; ++i) codes[start + i] = q(xs[i] / rule);
    }
  }
  return recovered;
}

void dequantize_blockwise(std::span<const uint8_t> codes, std::span<const float> absmax, int64_t block, QMap m,
                          std::span<float> out) {
  const float* map = qmap_table(m).data();
  // Block by block: no division per element (a 64-bit divide cost more than the lookup and multiply).
  const size_t b = static_cast<size_t>(block);
  for (size_t begin = 0, k = 0; begin < codes.size(); begin += b, ++k) {
    const size_t end = std::min(codes.size(), begin + b);
    const float scale = absmax[k];
    for (size_t i = begin; i < end; ++i) out[i] = map[codes[i]] * scale;
  }
}

}  // namespace optstate
