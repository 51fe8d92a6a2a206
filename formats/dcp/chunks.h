// A tensor stored as chunks (boxes of its global shape: DCP's ChunkStorageMetadata, a DTensor's
// local shard on each rank) seen as runs of consecutive flat elements, which is how optstate's
// readers stream an entry in flattened order and read a rank's range.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "dcp_layout.h"
#include "optstate/checkpoint.h"
#include "optstate/io.h"
#include "optstate/quant8.h"
#include "optstate/status.h"

namespace optstate::dcp {

// Runs of one chunk beyond this many (a column-sharded tensor of huge row count) are refused.
inline constexpr uint64_t kMaxSegments = uint64_t{1} << 24;

struct Segment {
  int64_t begin, count;  // flat elements of the global tensor (or blocks, for absmax)
  size_t chunk;          // index into the item's chunks
  int64_t local;         // element offset inside that chunk's data
};

// A chunk box (offsets, sizes) of a tensor of shape `g` as runs of consecutive flat elements, in
// the chunk's own C order, appended to `out`.
Status chunk_segments(const std::vector<int64_t>& g, const ChunkMeta& c, size_t chunk, std::vector<Segment>& out,
                      const std::string& where);

// Chunk `chunk` of item `im` as runs of the flat elements of the tensor it holds: chunk_segments
// over its size, or for Megatron-Core's N-D flattened item (ItemMeta::nd_shape; check_nd_flattened
// has passed) the runs of its chunk box that the chunk's element range covers, consecutive runs
// merged.
Status item_segments(const ItemMeta& im, size_t chunk, std::vector<Segment>& out, const std::string& where);

// Sorts `segs` by position and checks they cover [0, count) once: no holes, no overlaps.
Status check_coverage(std::vector<Segment>& segs, int64_t count, const std::string& where);

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
