#include "chunks.h"

#include <fmt/format.h>

#include <algorithm>

namespace optstate::dcp {

Status chunk_segments(const std::vector<int64_t>& g, const ChunkMeta& c, size_t chunk, std::vector<Segment>& out,
                      const std::string& where) {
  const size_t n = g.size();
  for (int64_t s : c.sizes)
    if (s == 0) return Status::Ok();
  if (n == 0) {
    out.push_back({0, 1, chunk, 0});
    return Status::Ok();
  }
  std::vector<int64_t> stride(n, 1);
  for (size_t d = n - 1; d > 0; --d) stride[d - 1] = stride[d] * g[d];
  // Dims after j are covered whole, so a run spans dim j's extent in the box.
  size_t j = n - 1;
  while (j > 0 && c.offsets[j] == 0 && c.sizes[j] == g[j]) --j;
  const int64_t run = c.sizes[j] * stride[j];
  std::vector<int64_t> idx(c.offsets.begin(), c.offsets.begin() + static_cast<long>(j));
  int64_t local = 0;
  while (true) {
    int64_t begin = c.offsets[j] * stride[j];
    for (size_t d = 0; d < j; ++d) begin += idx[d] * stride[d];
    if (out.size() >= kMaxSegments) return corrupt(where + ": too many pieces (column-sharded beyond the cap)");
    out.push_back({begin, run, chunk, local});
    local += run;
    size_t d = j;
    while (d > 0) {
      --d;
      if (++idx[d] < c.offsets[d] + c.sizes[d]) break;
      idx[d] = c.offsets[d];
      if (d == 0) return Status::Ok();
    }
    if (j == 0) return Status::Ok();
  }
}

Status check_coverage(std::vector<Segment>& segs, int64_t count, const std::string& where) {
  std::sort(segs.begin(), segs.end(), [](const Segment& a, const Segment& b) { return a.begin < b.begin; });
  int64_t at = 0;
  for (const Segment& s : segs) {
    if (s.begin != at)
      return corrupt(fmt::format("{}: elements [{}, {}) {}", where, std::min(at, s.begin), std::max(at, s.begin),
                                 s.begin > at ? "are in no chunk" : "are in two chunks"));
    at += s.count;
  }
  if (at != count) return corrupt(fmt::format("{}: elements [{}, {}) are in no chunk", where, at, count));
  return Status::Ok();
}

}  // namespace optstate::dcp
