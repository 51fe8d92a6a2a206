// Blockwise 8-bit quantization (DESIGN §1 "blockwise8"): the two dynamic maps and the exact
// quantize/dequantize rules of torchao's AdamW8bit and bitsandbytes' blockwise 8-bit optimizers.
// Pure functions over spans; no LibTorch.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "optstate/status.h"

namespace optstate {

enum class QMap : uint8_t { kDynamicSigned, kDynamicUnsigned };

inline constexpr int64_t kDefaultBlockSize = 256;
inline constexpr int64_t kDefaultMin8bitSize = 4096;
inline constexpr float kMinAbsmax = 1e-12f;  // absmax (the block scale) is clamped to at least this

std::string_view qmap_name(QMap m);  // "dynamic-signed" / "dynamic-unsigned"
Result<QMap> qmap_from_name(std::string_view name);
// The 256 sorted fp32 values of a map. Signed: 0 at index 127, 1 at 255, min -0.99297.
// Unsigned: 0 at index 0, 1 at 255.
const std::array<float, 256>& qmap_table(QMap m);

// The code of one value already divided by its block scale: the largest c with map[c] <= x (0 when
// none; a branchless 8-step binary search), then rounded up to c+1 when
// x - map[c] >= (map[c+1] - map[c]) * 0.5 (ties go up). NaN gives 0. The reference definition.
uint8_t quantize_scaled_reference(float x, const float* map);

// The same result as quantize_scaled_reference without a search. The reference is monotone in x, so
// the code of x is the number of "thresholds" t[c] <= x, where t[c] is the least float whose code
// exceeds c. Buckets split |x| by its top bits (2^m per binade, m as small as leaves at most one
// threshold per bucket: 6 for the signed map, 7 for the unsigned one) and by its sign. One 32-bit
// entry per bucket holds the code at the bucket's smallest magnitude and where, in the low bits of
// |x|, the code steps (up for x >= 0, down for x < 0), so
//   code = base +/- (low bits of |x| >= step)
// is exact with one table read, which SIMD code does as one gather per eight values. Magnitudes below
// the first bucket share it and those of 2 or more share the last one (neither holds a threshold;
// checked when the table is built). NaN gives 0. Built once per map.
class Quantizer {
 public:
  struct Buckets {
    const uint32_t* entry;  // [count] for x >= 0, then [count] for x < 0 when negative_half
    uint32_t shift;         // 23 - m: |x| bits >> shift is x's bucket number in all floats
    uint32_t first;         // the bucket number of entry[0]
    uint32_t count;         // buckets per sign
    bool negative_half;     // without it (unsigned map) every x < 0 has code 0
  };
  static constexpr uint32_t kBaseBits = 8;  // entry = base | step << kBaseBits; step == 1 << shift: none

  explicit Quantizer(QMap m);
  static const Quantizer& get(QMap m);
  uint8_t operator()(float x) const {
    uint32_t bits;
    __builtin_memcpy(&bits, &x, 4);
    const uint32_t mag = bits & 0x7fffffffu, neg = bits >> 31;
    if (mag > 0x7f800000u || (neg && !buckets_.negative_half)) return 0;  // NaN; x < 0 for unsigned
    int32_t k = static_cast<int32_t>(mag >> buckets_.shift) - static_cast<int32_t>(buckets_.first);
    k = k < 0 ? 0 : k;
    k = k > static_cast<int32_t>(buckets_.count) - 1 ? static_cast<int32_t>(buckets_.count) - 1 : k;
    const uint32_t e = entry_[static_cast<uint32_t>(k) + neg * buckets_.count];
    const uint32_t stepped = (mag & ((1u << buckets_.shift) - 1)) >= (e >> kBaseBits);
    const uint32_t base = e & 0xffu;
    return static_cast<uint8_t>(neg ? base - stepped : base + stepped);
  }
  const float* map() const { return map_; }
  const Buckets& buckets() const { return buckets_; }
  const float* thresholds() const { return threshold_.data(); }

 private:
  const float* map_;
  std::vector<uint32_t> entry_;
  Buckets buckets_{};
  std::array<float, 257> threshold_;  // t[255] = t[256] = +inf: no code above 255
};

// max |x| over the block, clamped to >= 1e-12; NaN when the block holds a NaN (torch's amax and
// clip propagate it, and every code of such a block is then 0).
float block_scale(std::span<const float> x);

// Quantizes consecutive blocks of `block` elements (the last may be partial): absmax[b] is the
// block's scale, codes[i] the code of x[i] / absmax[i / block].
void quantize_blockwise(std::span<const float> x, int64_t block, QMap m, std::span<uint8_t> codes,
                        std::span<float> absmax);
// For converting dense values back to 8-bit: each block is quantized by the rule above, except
// that a block whose values are exactly the dequantization of some (codes, absmax) pair of this map
// gets that pair back, so 8-bit -> fp32 -> 8-bit reproduces the codes. (By the rule alone a block
// whose largest magnitude came from a negative value, dequantized as -0.99297 * absmax, would be
// rescaled.) Returns the number of blocks recovered that way.
int64_t requantize_blockwise(std::span<const float> x, int64_t block, QMap m, std::span<uint8_t> codes,
                             std::span<float> absmax);

// out[i] = map[codes[i]] * absmax[i / block]
void dequantize_blockwise(std::span<const uint8_t> codes, std::span<const float> absmax, int64_t block, QMap m,
                          std::span<float> out);

}  // namespace optstate
