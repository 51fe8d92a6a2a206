#include "chunks.h"

#include <fmt/format.h>

#include <algorithm>

#include "zip.h"

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

Status item_segments(const ItemMeta& im, size_t chunk, std::vector<Segment>& out, const std::string& where) {
  const ChunkMeta& c = im.chunks.at(chunk);
  if (im.nd_shape.empty()) return chunk_segments(im.size, c, chunk, out, where);
  const std::vector<int64_t>& g = im.nd_shape;
  const size_t n = g.size();
  const int64_t start = c.offsets[n], count = c.sizes[n];
  if (count == 0) return Status::Ok();
  if (n == 0) {  // a scalar: its one element
    out.push_back({0, 1, chunk, 0});
    return Status::Ok();
  }
  std::vector<int64_t> box(n), stride(n, 1);
  for (size_t d = 0; d < n; ++d) box[d] = g[d] / im.size[d];
  for (size_t d = n - 1; d > 0; --d) stride[d - 1] = stride[d] * g[d];
  const int64_t row = box[n - 1];  // a box row: consecutive in the tensor
  // Start at element `start` of the box (C order over `box`), then walk row by row.
  std::vector<int64_t> idx(n);
  int64_t rest = start / row;
  for (size_t d = n - 1; d-- > 0;) {
    idx[d] = rest % box[d];
    rest /= box[d];
  }
  idx[n - 1] = start % row;
  int64_t local = 0;
  while (local < count) {
    int64_t begin = 0;
    for (size_t d = 0; d < n; ++d) begin += (c.offsets[d] * box[d] + idx[d]) * stride[d];
    const int64_t run = std::min(row - idx[n - 1], count - local);
    if (!out.empty() && out.back().chunk == chunk && out.back().begin + out.back().count == begin &&
        out.back().local + out.back().count == local) {
      out.back().count += run;  // the box spans whole rows of the tensor
    } else {
      if (out.size() >= kMaxSegments) return corrupt(where + ": too many pieces (column-sharded beyond the cap)");
      out.push_back({begin, run, chunk, local});
    }
    local += run;
    idx[n - 1] = 0;
    for (size_t d = n - 1; d-- > 0;)
      if (++idx[d] < box[d]) break;
      else idx[d] = 0;
  }
  return Status::Ok();
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

Status stream_dequantized(const InputFile& file, uint64_t codes_at, int64_t from, int64_t to,
                          std::span<const float> scales, int64_t block, const std::array<float, 256>& table,
                          const ByteSink& sink, uint32_t* crc, const std::string& where, int bits) {
  if (from < 0 || to < from || block <= 0 || (to > from && (to - 1) / block >= static_cast<int64_t>(scales.size())))
    return corrupt(fmt::format("{}: 8-bit elements [{}, {}) are past its {} scales of blocks of {}", where, from, to,
                               scales.size(), block));
  constexpr int64_t kStep = int64_t{1} << 20;  // even: 4-bit steps begin on a byte
  std::vector<uint8_t> codes, packed;
  std::vector<float> values;
  for (int64_t at = from; at < to; at += kStep) {
    const int64_t n = std::min(kStep, to - at);
    codes.resize(static_cast<size_t>(n));
    values.resize(static_cast<size_t>(n));
    if (bits == 4) {  // the bytes holding codes [at, at + n), unpacked
      const int64_t first = at / 2, last = (at + n + 1) / 2;
      packed.resize(static_cast<size_t>(last - first));
      OPTSTATE_RETURN_IF_ERROR(file.read_at(codes_at + static_cast<uint64_t>(first), std::as_writable_bytes(std::span(packed)))
                                   .with_context(where));
      if (crc) *crc = zip::crc32(std::as_bytes(std::span(packed)), *crc);
      for (int64_t k = 0; k < n; ++k) {
        const int64_t e = at + k;
        const uint8_t byte = packed[static_cast<size_t>(e / 2 - first)];
        codes[static_cast<size_t>(k)] = e % 2 == 0 ? byte >> 4 : byte & 15;
      }
    } else {
      OPTSTATE_RETURN_IF_ERROR(
          file.read_at(codes_at + static_cast<uint64_t>(at), std::as_writable_bytes(std::span(codes))).with_context(where));
      if (crc) *crc = zip::crc32(std::as_bytes(std::span(codes)), *crc);
    }
    // The block and the position in it are carried along: a division per element would cost more
    // than the lookup and the multiply.
    size_t blk = static_cast<size_t>(at / block);
    int64_t in = at % block;
    for (int64_t k = 0; k < n; ++k) {
      values[static_cast<size_t>(k)] = table[codes[static_cast<size_t>(k)]] * scales[blk];
      if (++in == block) {
        in = 0;
        ++blk;
      }
    }
    OPTSTATE_RETURN_IF_ERROR(sink(std::as_bytes(std::span(values))));
  }
  return Status::Ok();
}

}  // namespace optstate::dcp
