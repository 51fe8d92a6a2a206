// A tensor stored as chunks (boxes of its global shape: DCP's ChunkStorageMetadata, a DTensor's
// local shard on each rank) seen as runs of consecutive flat elements, which is how optstate's
// readers stream an entry in flattened order and read a rank's range.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "dcp_layout.h"
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

// Sorts `segs` by position and checks they cover [0, count) once: no holes, no overlaps.
Status check_coverage(std::vector<Segment>& segs, int64_t count, const std::string& where);

}  // namespace optstate::dcp
