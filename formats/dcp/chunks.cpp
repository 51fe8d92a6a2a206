#include "chunks.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <queue>

#include "zip.h"

namespace optstate::dcp {

Status RunList::add(const Runs& in, const std::string& where) {
  if (in.rows <= 0 || in.count <= 0) return Status::Ok();
  Runs r = in;
  if (r.rows == 1) r.stride = 0;
  runs_ += static_cast<uint64_t>(r.rows);
  if (runs_ > kMaxRuns) return corrupt(where + ": too many pieces (column-sharded beyond the cap)");
  if (!groups_.empty() && r.rows == 1) {
    Runs& last = groups_.back();
    if (last.chunk == r.chunk && r.local == last.local + last.rows * last.count) {
      if (last.rows == 1 && r.begin == last.begin + last.count) {  // the next elements
        last.count += r.count;
        return Status::Ok();
      }
      if (r.count == last.count &&
          (last.rows == 1 ? r.begin > last.begin + last.count : r.begin == last.begin + last.rows * last.stride)) {
        if (last.rows == 1) last.stride = r.begin - last.begin;  // the next row
        ++last.rows;
        return Status::Ok();
      }
    }
  }
  if (groups_.size() >= kMaxRunGroups) return corrupt(where + ": too many pieces (column-sharded beyond the cap)");
  groups_.push_back(r);
  return Status::Ok();
}

Status RunList::seal(int64_t count, const std::string& where) {
  std::sort(groups_.begin(), groups_.end(), [](const Runs& a, const Runs& b) { return a.begin < b.begin; });
  count_ = count;
  interleaved_ = false;
  max_end_.resize(groups_.size());
  for (size_t i = 0; i < groups_.size(); ++i) {
    max_end_[i] = std::max(i ? max_end_[i - 1] : int64_t{0}, groups_[i].end());
    interleaved_ = interleaved_ || groups_[i].rows > 1 || (i > 0 && max_end_[i - 1] > groups_[i].begin);
  }
  int64_t at = 0;
  auto next = [&](const Segment& s) -> Status {
    if (s.begin != at)
      return corrupt(fmt::format("{}: elements [{}, {}) {}", where, std::min(at, s.begin), std::max(at, s.begin),
                                 s.begin > at ? "are in no chunk" : "are in two chunks"));
    at += s.count;
    return Status::Ok();
  };
  if (interleaved_) {  // run by run, in flat order (runs_ <= kMaxRuns bounds the walk)
    OPTSTATE_RETURN_IF_ERROR(for_each(0, std::numeric_limits<int64_t>::max(), next));
  } else {
    for (const Runs& g : groups_) OPTSTATE_RETURN_IF_ERROR(next(g.run(0)));
  }
  if (at != count) return corrupt(fmt::format("{}: elements [{}, {}) are in no chunk", where, at, count));
  return Status::Ok();
}

namespace {

// The first of a group's runs that ends past `from` (g.rows where none does).
int64_t first_row(const Runs& g, int64_t from) {
  const int64_t past = from - g.begin - g.count;
  if (past < 0) return 0;
  return g.rows == 1 ? 1 : std::min(g.rows, past / g.stride + 1);
}

}  // namespace

Status RunList::for_each_group(int64_t from, int64_t to,
                               const std::function<Status(const Runs&, int64_t, int64_t)>& fn) const {
  if (from >= to) return Status::Ok();
  auto i = static_cast<size_t>(
      std::partition_point(max_end_.begin(), max_end_.end(), [&](int64_t e) { return e <= from; }) - max_end_.begin());
  for (; i < groups_.size() && groups_[i].begin < to; ++i) {
    const Runs& g = groups_[i];
    const int64_t r0 = first_row(g, from);
    if (r0 >= g.rows || g.begin + r0 * g.stride >= to) continue;
    const int64_t r1 = g.rows == 1 ? 1 : std::min(g.rows, (to - 1 - g.begin) / g.stride + 1);
    OPTSTATE_RETURN_IF_ERROR(fn(g, r0, r1));
  }
  return Status::Ok();
}

Status RunList::for_each(int64_t from, int64_t to, const std::function<Status(const Segment&)>& fn) const {
  if (from >= to || groups_.empty()) return Status::Ok();
  if (!interleaved_) {  // one run a group, the groups one after another
    auto it = std::partition_point(groups_.begin(), groups_.end(), [&](const Runs& g) { return g.end() <= from; });
    for (; it != groups_.end() && it->begin < to; ++it) OPTSTATE_RETURN_IF_ERROR(fn(it->run(0)));
    return Status::Ok();
  }
  // Runs of several groups interleave: a heap of each group's next run, groups taken in as the
  // walk reaches their first element (a group's runs all lie at or after it).
  struct Next {
    int64_t begin;
    size_t group;
    int64_t row;
    bool operator>(const Next& o) const { return begin > o.begin; }
  };
  std::priority_queue<Next, std::vector<Next>, std::greater<Next>> heap;
  auto push = [&](size_t gi, int64_t r) {
    const Runs& g = groups_[gi];
    if (r >= g.rows) return;
    const int64_t b = g.begin + r * g.stride;
    if (b < to) heap.push({b, gi, r});
  };
  size_t i = static_cast<size_t>(
      std::partition_point(max_end_.begin(), max_end_.end(), [&](int64_t e) { return e <= from; }) - max_end_.begin());
  while (true) {
    while (i < groups_.size() && groups_[i].begin < to && (heap.empty() || groups_[i].begin <= heap.top().begin)) {
      push(i, first_row(groups_[i], from));
      ++i;
    }
    if (heap.empty()) return Status::Ok();
    const Next n = heap.top();
    heap.pop();
    OPTSTATE_RETURN_IF_ERROR(fn(groups_[n.group].run(n.row)));
    push(n.group, n.row + 1);
  }
}

Status chunk_segments(const std::vector<int64_t>& g, const ChunkMeta& c, size_t chunk, RunList& out,
                      const std::string& where) {
  const size_t n = g.size();
  for (int64_t s : c.sizes)
    if (s == 0) return Status::Ok();
  if (n == 0) return out.add(Segment{0, 1, chunk, 0}, where);
  std::vector<int64_t> stride(n, 1);
  for (size_t d = n - 1; d > 0; --d) stride[d - 1] = stride[d] * g[d];
  // Dims after j are covered whole, so a run spans dim j's extent in the box.
  size_t j = n - 1;
  while (j > 0 && c.offsets[j] == 0 && c.sizes[j] == g[j]) --j;
  const int64_t run = c.sizes[j] * stride[j];
  int64_t base = c.offsets[j] * stride[j];
  if (j == 0) return out.add(Segment{base, run, chunk, 0}, where);
  // Rows step dim j - 1 at its stride, and the dims above it as long as the one below is covered
  // whole (its last row is then one stride from the next index's first).
  size_t k = j - 1;
  int64_t rows = c.sizes[k];
  base += c.offsets[k] * stride[k];
  while (k > 0 && c.offsets[k] == 0 && c.sizes[k] == g[k]) {
    --k;
    rows *= c.sizes[k];
    base += c.offsets[k] * stride[k];
  }
  // One group of rows per index of the dims above k.
  std::vector<int64_t> idx(c.offsets.begin(), c.offsets.begin() + static_cast<long>(k));
  int64_t local = 0;
  while (true) {
    int64_t begin = base;
    for (size_t d = 0; d < k; ++d) begin += idx[d] * stride[d];
    OPTSTATE_RETURN_IF_ERROR(out.add(Runs{begin, run, rows, stride[j - 1], chunk, local}, where));
    local += rows * run;
    size_t d = k;
    while (d > 0) {
      --d;
      if (++idx[d] < c.offsets[d] + c.sizes[d]) break;
      idx[d] = c.offsets[d];
      if (d == 0) return Status::Ok();
    }
    if (k == 0) return Status::Ok();
  }
}

Status item_segments(const ItemMeta& im, size_t chunk, RunList& out, const std::string& where) {
  const ChunkMeta& c = im.chunks.at(chunk);
  if (im.nd_shape.empty()) return chunk_segments(im.size, c, chunk, out, where);
  const std::vector<int64_t>& g = im.nd_shape;
  const size_t n = g.size();
  const int64_t start = c.offsets[n], count = c.sizes[n];
  if (count == 0) return Status::Ok();
  if (n == 0) return out.add(Segment{0, 1, chunk, 0}, where);  // a scalar: its one element
  std::vector<int64_t> box(n), stride(n, 1);
  for (size_t d = 0; d < n; ++d) box[d] = g[d] / im.size[d];
  for (size_t d = n - 1; d > 0; --d) stride[d - 1] = stride[d] * g[d];
  const int64_t row = box[n - 1];  // a box row: consecutive in the tensor
  // Start at element `start` of the box (C order over `box`), then walk row by row (RunList joins
  // consecutive rows, and rows at one stride).
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
    OPTSTATE_RETURN_IF_ERROR(out.add(Segment{begin, run, chunk, local}, where));
    local += run;
    idx[n - 1] = 0;
    for (size_t d = n - 1; d-- > 0;)
      if (++idx[d] < box[d]) break;
      else idx[d] = 0;
  }
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
