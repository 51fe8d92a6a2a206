// A tensor stored as chunks (boxes of its global shape: DCP's ChunkStorageMetadata, a DTensor's
// local shard on each rank) seen as runs of consecutive flat elements, which is how optstate's
// readers stream an entry in flattened order and read a rank's range.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "dcp_layout.h"
#include "optstate/checkpoint.h"
#include "optstate/io.h"
#include "optstate/quant8.h"
#include "optstate/status.h"

namespace optstate::dcp {

// Caps against hostile chunking, per tensor: groups of runs kept, and runs looked at when a
// tensor's chunks interleave (column shards) and their coverage is walked run by run.
inline constexpr uint64_t kMaxRunGroups = uint64_t{1} << 24;
inline constexpr uint64_t kMaxRuns = uint64_t{1} << 28;

// One run: consecutive flat elements of the global tensor that lie consecutively in one chunk.
struct Segment {
  int64_t begin, count;  // flat elements of the global tensor (or blocks, for absmax)
  size_t chunk;          // index into the item's chunks
  int64_t local;         // element offset inside that chunk's data
};

// `rows` runs of `count` elements of one chunk, the r-th at flat element begin + r * stride of the
// tensor and at local + r * count of the chunk's data. A column shard [rows, cols / tp] of a
// row-parallel weight is one of these, not a run per row (10 million of them in a 70B model at
// tensor parallel 8).
struct Runs {
  int64_t begin = 0, count = 0, rows = 1, stride = 0;
  size_t chunk = 0;
  int64_t local = 0;
  Segment run(int64_t r) const { return {begin + r * stride, count, chunk, local + r * count}; }
  int64_t end() const { return begin + (rows - 1) * stride + count; }  // past its last run
};

// Every chunk's runs of one tensor (or of its absmax blocks), which must cover it once, visited in
// flat order: where chunks interleave (column shards), run by run across them.
class RunList {
 public:
  // Appends runs of a chunk, a single run joined to the last runs it continues (the next
  // consecutive elements, or the next row at a fixed stride); capped at kMaxRunGroups groups and
  // kMaxRuns runs.
  Status add(const Runs& r, const std::string& where);
  Status add(const Segment& s, const std::string& where) { return add(Runs{s.begin, s.count, 1, 0, s.chunk, s.local}, where); }
  // Sorts the runs and checks they cover [0, count) once: no holes, no overlaps (the error names
  // the first elements that are in no chunk or in two).
  Status seal(int64_t count, const std::string& where);
  // Calls `fn` for each run that overlaps [from, to), in flat order, stopping at its first error.
  // After seal().
  Status for_each(int64_t from, int64_t to, const std::function<Status(const Segment&)>& fn) const;
  // Calls `fn(group, r0, r1)` for each group whose runs [r0, r1) overlap [from, to), groups in
  // order of their first element (so a chunk's rows are met in order). After seal().
  Status for_each_group(int64_t from, int64_t to,
                        const std::function<Status(const Runs&, int64_t, int64_t)>& fn) const;
  // Whether some chunk's runs lie between another's (column shards): flat order is then run by run.
  bool interleaved() const { return interleaved_; }
  int64_t count() const { return count_; }
  bool empty() const { return groups_.empty(); }
  std::span<const Runs> groups() const { return groups_; }
  void clear() { *this = RunList{}; }

 private:
  std::vector<Runs> groups_;      // by begin, once sealed
  std::vector<int64_t> max_end_;  // max end() of groups_[0..i]: where interleaved runs may still reach
  bool interleaved_ = false;      // some group's runs lie between another's
  uint64_t runs_ = 0;
  int64_t count_ = 0;
};

// A chunk box (offsets, sizes) of a tensor of shape `g` as runs of consecutive flat elements, in
// the chunk's own C order, appended to `out`: one Runs per index of the box's outer dims that do
// not fold into one stride.
Status chunk_segments(const std::vector<int64_t>& g, const ChunkMeta& c, size_t chunk, RunList& out,
                      const std::string& where);

// Chunk `chunk` of item `im` as runs of the flat elements of the tensor it holds: chunk_segments
// over its size, or for Megatron-Core's N-D flattened item (ItemMeta::nd_shape; check_nd_flattened
// has passed) the runs of its chunk box that the chunk's element range covers, consecutive runs
// merged.
Status item_segments(const ItemMeta& im, size_t chunk, RunList& out, const std::string& where);

// Elements [from, to) of one rank's 8-bit part as fp32 values, through `sink` in bounded pieces:
// torchao quantizes each rank's shard as its own tensor (OptimState8bit: blocks of `block` from the
// part's first element), so a part that cannot join blockwise8 state of the whole tensor (8-bit on
// some ranks only) is read as table[code] * scale[block], the values torchao's dequantize() gives:
// `table` is the part's map (qmap_table), or float8_e4m3fn's values for OptimStateFp8's codes.
// `codes_at`: the file offset of the part's first code. With `crc`, the CRC-32 of the code bytes
// read is accumulated there. `bits` 4: two codes a byte, the first in the high nibble (torchao's
// OptimState4bit, whose 16-entry map fills the table's first 16 values).
Status stream_dequantized(const InputFile& file, uint64_t codes_at, int64_t from, int64_t to,
                          std::span<const float> scales, int64_t block, const std::array<float, 256>& table,
                          const ByteSink& sink, uint32_t* crc, const std::string& where, int bits = 8);

}  // namespace optstate::dcp
