// The quantizer's one-threshold bucket table: its layout and its lookup (Quantizer in quant8.h
// builds the entries). Header-only, no LibTorch, host and device: the CPU quantizer and the CUDA
// kernels (which copy the same entries into shared memory) read one table by one rule, so the
// check of that table against the reference quantizer (every float, both maps) covers both.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define OPTSTATE_QUANT_HD __host__ __device__ __forceinline__
#else
#define OPTSTATE_QUANT_HD inline
#endif

namespace optstate {

// Buckets split |x| by its top bits, 2^m per binade, and by sign. Magnitudes below 2^-24 share the
// first bucket (the maps' smallest thresholds are near 2^-22) and those of 2 or more share the last.
struct BucketLayout {
  uint32_t shift;      // 23 - m: |x| bits >> shift is x's bucket number among all floats
  uint32_t first;      // the bucket number of entry[0]
  uint32_t count;      // buckets per sign
  bool negative_half;  // entries for x < 0 follow those for x >= 0; without them every x < 0 has code 0
};

// m as small as leaves at most one threshold per bucket: 6 for the signed map (1600 buckets per
// sign), 7 for the unsigned one (3200). 12.5 KB of entries either way.
OPTSTATE_QUANT_HD constexpr BucketLayout bucket_layout(bool signed_map) {
  const uint32_t m = signed_map ? 6u : 7u;
  return {23u - m, 103u << m, (128u << m) - (103u << m), signed_map};
}
OPTSTATE_QUANT_HD constexpr uint32_t bucket_entries(const BucketLayout& b) {
  return b.count * (b.negative_half ? 2u : 1u);
}

// entry = base | step << kBucketBaseBits, and code = base + (low >= step), where low is x's low bits
// (|x| bits & (2^shift - 1)) for x >= 0 and their complement in those bits for x < 0 (so low grows
// towards the bucket's top magnitude for x >= 0 and its bottom one for x < 0: the code grows with x
// both ways). base is the code at the bucket's low end in x; step == 2^shift: no step in this bucket.
inline constexpr uint32_t kBucketBaseBits = 8;

// The code of x (any float; NaN gives 0): one table read and one comparison.
OPTSTATE_QUANT_HD uint8_t bucket_code(float x, const uint32_t* entry, const BucketLayout& b) {
  uint32_t bits;
  memcpy(&bits, &x, 4);
  const uint32_t mag = bits & 0x7fffffffu, neg = bits >> 31;
  int32_t k = static_cast<int32_t>(mag >> b.shift) - static_cast<int32_t>(b.first);
  k = k < 0 ? 0 : k;
  k = k > static_cast<int32_t>(b.count) - 1 ? static_cast<int32_t>(b.count) - 1 : k;
  const uint32_t e = entry[static_cast<uint32_t>(k) + (b.negative_half ? neg * b.count : 0u)];
  const uint32_t low = (bits ^ (0u - neg)) & ((1u << b.shift) - 1u);  // complemented for x < 0
  const uint32_t code = (e & 0xffu) + (low >= (e >> kBucketBaseBits) ? 1u : 0u);
  return mag > 0x7f800000u || (neg && !b.negative_half) ? uint8_t{0} : static_cast<uint8_t>(code);
}

}  // namespace optstate
