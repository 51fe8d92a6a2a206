// Blockwise 8-bit quantization (DESIGN §1 "blockwise8"): the two dynamic maps and the exact
// quantize/dequantize rules of torchao's AdamW8bit and bitsandbytes' blockwise 8-bit optimizers.
// Pure functions over spans; no LibTorch.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "optstate/quant8_buckets.h"
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
// The map whose table is `m` bit for bit (how a map stored beside codes, torchao's qmap, is named).
std::optional<QMap> qmap_matching(const std::array<float, 256>& m);

// The code of one value already divided by its block scale: the largest c with map[c] <= x (0 when
// none; a branchless 8-step binary search), then rounded up to c+1 when
// x - map[c] >= (map[c+1] - map[c]) * 0.5 (ties go up). NaN gives 0. The reference definition.
uint8_t quantize_scaled_reference(float x, const float* map);

// The same result as quantize_scaled_reference without a search. The reference is monotone in x, so
// the code of x is the number of "thresholds" t[c] <= x, where t[c] is the least float whose code
// exceeds c. A bucket table (quant8_buckets.h: layout, entries and the lookup, shared with the CUDA
// kernels) holds at most one threshold per bucket, so one 32-bit entry per bucket gives
//   code = base + (low bits of x, complemented for x < 0, >= step)
// exactly, with one table read, which SIMD code does as one gather per eight values. The builder
// checks that no bucket holds two thresholds and that the shared first and last buckets hold none.
// NaN gives 0. Built once per map.
class Quantizer {
 public:
  explicit Quantizer(QMap m);
  static const Quantizer& get(QMap m);
  uint8_t operator()(float x) const { return bucket_code(x, entry_.data(), layout_); }
  const float* map() const { return map_; }
  const BucketLayout& layout() const { return layout_; }
  const uint32_t* entries() const { return entry_.data(); }  // bucket_entries(layout()) of them
  const float* thresholds() const { return threshold_.data(); }

 private:
  const float* map_;
  BucketLayout layout_;
  std::vector<uint32_t> entry_;
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
