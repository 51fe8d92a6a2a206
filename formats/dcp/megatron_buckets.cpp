#include "megatron_buckets.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <map>

namespace optstate::dcp::megatron {

namespace {

constexpr std::string_view kDistributed = "optimizer.distributed.dp_group_idx_";
// Megatron aligns each param's start in a buffer to 64 elements (param_layout.pad_param_start):
// what lies between two params is shorter.
constexpr int64_t kParamAlignment = 64;
// Elements compared at once where a whole run is (a bounded buffer for any param's size).
constexpr int64_t kComparePiece = int64_t{1} << 20;

// "[chained_<i>.]" -> i (-1 without), the rest in `rest`; nullopt for a malformed prefix.
std::optional<int> chain_prefix(std::string_view& rest) {
  if (!rest.starts_with("chained_")) return -1;
  std::string_view r = rest.substr(8);
  const auto dot = r.find('.');
  if (dot == std::string_view::npos || dot == 0 || dot > 2) return std::nullopt;
  int i = 0;
  if (std::from_chars(r.data(), r.data() + dot, i).ptr != r.data() + dot) return std::nullopt;
  rest = r.substr(dot + 1);
  return i;
}

// "<digits><sep>..." -> the number, `rest` past the separator (sep empty: the whole rest).
std::optional<int64_t> number_then(std::string_view& rest, std::string_view sep) {
  const auto end = sep.empty() ? rest.size() : rest.find(sep);
  if (end == std::string_view::npos || end == 0 || end > 18) return std::nullopt;
  int64_t v = 0;
  if (std::from_chars(rest.data(), rest.data() + end, v).ptr != rest.data() + end) return std::nullopt;
  rest = rest.substr(end + sep.size());
  return v;
}

}  // namespace

std::optional<BucketKey> bucket_key(std::string_view key) {
  BucketKey out;
  const auto chain = chain_prefix(key);
  if (!chain || !key.starts_with(kDistributed)) return std::nullopt;
  out.chain = *chain;
  key = key.substr(kDistributed.size());
  const auto group = number_then(key, ".gbuf_idx_");
  const auto gbuf = group ? number_then(key, ".dtype_") : std::nullopt;
  if (!gbuf) return std::nullopt;
  // the dtype key may hold dots ("(torch.bfloat16, torch.float32)"): up to the last .bucket_idx_
  const auto b = key.rfind(".bucket_idx_");
  if (b == std::string_view::npos || b == 0) return std::nullopt;
  out.dtype = std::string(key.substr(0, b));
  key = key.substr(b + 12);
  const auto bucket = number_then(key, ".");
  if (!bucket || key.empty() || key.find('.') != std::string_view::npos) return std::nullopt;
  out.group = *group;
  out.gbuf = *gbuf;
  out.bucket = *bucket;
  out.entry = std::string(key);
  return out;
}

std::optional<std::pair<int, int64_t>> group_optimizer_key(std::string_view key) {
  const auto chain = chain_prefix(key);
  if (!chain || !key.starts_with(kDistributed)) return std::nullopt;
  key = key.substr(kDistributed.size());
  const auto group = number_then(key, ".");
  if (!group || key != "optimizer") return std::nullopt;
  return std::pair{*chain, *group};
}

std::optional<std::pair<int, int64_t>> param_state_key(std::string_view key) {
  const auto chain = chain_prefix(key);
  if (!chain || !key.starts_with(kDistributed)) return std::nullopt;
  key = key.substr(kDistributed.size());
  const auto group = number_then(key, ".");
  if (!group || !key.starts_with("param_state/shard_")) return std::nullopt;
  return std::pair{*chain, *group};
}

Result<std::vector<int64_t>> flat_buffer_bounds(size_t bucket, int64_t numel, DType dtype,
                                               const std::vector<Box>& boxes, const BucketValues& values,
                                               const std::string& where) {
  constexpr int64_t kPrefix = 4;         // elements a box is looked up by
  constexpr size_t kMaxSameFirst = 4096;  // boxes compared at one start (equal first elements)
  // the boxes of the buffer's dtype by their first elements (fewer for a box that short)
  std::map<std::vector<uint32_t>, std::vector<size_t>> by_first;
  std::vector<std::optional<std::vector<uint32_t>>> samples(boxes.size());
  for (size_t i = 0; i < boxes.size(); ++i) {
    if (boxes[i].dtype != dtype || boxes[i].numel <= 0 || boxes[i].numel > numel) continue;
    std::vector<int64_t> at;
    for (int64_t k = 0; k < std::min(kPrefix, boxes[i].numel); ++k) at.push_back(k);
    OPTSTATE_ASSIGN_OR_RETURN(auto first, values.box(i, at));
    by_first[std::move(first)].push_back(i);
  }
  auto fits = [&](size_t i, int64_t start) -> Result<bool> {
    if (!samples[i]) {
      OPTSTATE_ASSIGN_OR_RETURN(auto v, values.box(i, sample_places(boxes[i].numel)));
      samples[i] = std::move(v);
    }
    OPTSTATE_ASSIGN_OR_RETURN(const auto got, values.bucket(bucket, start, sample_places(boxes[i].numel), dtype));
    return got == *samples[i];
  };
  std::vector<int64_t> bounds{0};
  int64_t at = 0, bucket_start = 0;
  while (at < numel) {
    const int64_t aligned = bucket_start + (at - bucket_start + kParamAlignment - 1) / kParamAlignment * kParamAlignment;
    std::vector<std::pair<int64_t, size_t>> found;  // (start, box)
    std::vector<int64_t> starts{at};
    if (aligned != at && aligned < numel) starts.push_back(aligned);
    for (const int64_t start : starts) {
      std::vector<int64_t> head;
      for (int64_t k = 0; k < std::min(kPrefix, numel - start); ++k) head.push_back(k);
      OPTSTATE_ASSIGN_OR_RETURN(const auto first, values.bucket(bucket, start, head, dtype));
      // a box is keyed by its first min(4, numel) elements: each prefix length finds those of that key
      for (size_t len = 1; len <= first.size(); ++len) {
        const auto same = by_first.find(std::vector<uint32_t>(first.begin(), first.begin() + static_cast<ptrdiff_t>(len)));
        if (same == by_first.end()) continue;
        size_t tried = 0;
        for (const size_t i : same->second) {
          if (boxes[i].numel > numel - start) continue;
          if (++tried > kMaxSameFirst)
            return unsupported(fmt::format("{}: more than {} weights begin as the buffer does at element {}", where,
                                           kMaxSameFirst, start));
          OPTSTATE_ASSIGN_OR_RETURN(const bool ok, fits(i, start));
          if (ok) found.emplace_back(start, i);
        }
      }
    }
    if (found.empty())
      return unsupported(fmt::format("{}: no model weight's values lie at element {} (nor at its 64-aligned start {}) "
                                     "of the flat buffer of {} elements: a param whose weights are not saved beside "
                                     "(or stale ones)",
                                     where, at, aligned, numel));
    const int64_t start = found[0].first;
    const int64_t n = boxes[found[0].second].numel;
    for (const auto& [s, i] : found) {
      if (s != start)
        return unsupported(fmt::format("{}: weights fit both where the last param ended (element {}) and at its "
                                       "64-aligned start {}: where the next param begins is not in the checkpoint",
                                       where, at, aligned));
      if (boxes[i].numel != n)
        return unsupported(fmt::format("{}: weights of {} and of {} elements both fit at element {}: where the next "
                                       "param ends is not in the checkpoint",
                                       where, n, boxes[i].numel, start));
    }
    if (start == at && at != aligned) bucket_start = start;  // a new bucket (its predecessor cut at its last param)
    if (start != 0) bounds.push_back(start);
    at = start + n;
    if (at < numel) bounds.push_back(at);
  }
  std::sort(bounds.begin(), bounds.end());
  bounds.erase(std::unique(bounds.begin(), bounds.end()), bounds.end());
  return bounds;
}

std::vector<int64_t> sample_places(int64_t numel) {
  std::vector<int64_t> at;
  if (numel <= 32) {
    for (int64_t i = 0; i < numel; ++i) at.push_back(i);
    return at;
  }
  for (int64_t i = 0; i < 8; ++i) at.push_back(i);
  for (int64_t i = 0; i < 16; ++i) at.push_back(8 + (numel - 16) * i / 16);
  for (int64_t i = numel - 8; i < numel; ++i) at.push_back(i);
  std::sort(at.begin(), at.end());
  at.erase(std::unique(at.begin(), at.end()), at.end());
  return at;
}

namespace {

struct Run {
  size_t bucket = 0;
  int64_t begin = 0, numel = 0;
  std::vector<size_t> boxes;  // the boxes whose values it holds (sorted)
  bool compared = false;      // boxes checked at every element (not only sampled)
};

class Placer {
 public:
  Placer(const std::vector<Bucket>& buckets, const std::vector<Box>& boxes, const std::vector<std::string>& names,
         const BucketValues& values, const std::string& where)
      : buckets_(buckets), boxes_(boxes), names_(names), values_(values), where_(where) {}

  Result<std::vector<std::optional<Placement>>> place() {
    for (size_t i = 0; i < boxes_.size(); ++i) {
      const Box& b = boxes_[i];
      if (b.key >= names_.size()) return invalid_argument(fmt::format("{}: box {} of no weight", where_, i));
      if (b.dtype != DType::kF32 && b.dtype != DType::kBF16 && b.dtype != DType::kF16) continue;
      if (b.numel > 0) by_numel_[b.numel].push_back(i);
    }
    samples_.resize(boxes_.size());
    // Work caps: a bucket's chunk bounds admit one or a few sizes at each start, and boxes compete
    // (compared everywhere) only where their values are equal; a file that makes far more is refused.
    uint64_t starts = 0, elements = 0;
    for (const Bucket& b : buckets_) {
      starts += b.starts.size();
      elements += static_cast<uint64_t>(std::max<int64_t>(b.numel, 0));
    }
    sample_budget_ = 64 * starts + (uint64_t{1} << 20);
    compare_budget_ = 8 * elements + (uint64_t{1} << 24);
    for (size_t b = 0; b < buckets_.size(); ++b) OPTSTATE_RETURN_IF_ERROR(find_runs(b));
    OPTSTATE_RETURN_IF_ERROR(settle_shared_boxes());
    for (size_t b = 0; b < buckets_.size(); ++b) OPTSTATE_RETURN_IF_ERROR(check_padding(b));
    return assign();
  }

 private:
  const std::string& bucket_name(size_t b) const { return buckets_[b].name; }
  std::string box_name(size_t i) const {
    return fmt::format("'{}' at ({})", names_[boxes_[i].key], fmt::join(boxes_[i].offsets, ", "));
  }

  Result<const std::vector<uint32_t>*> box_sample(size_t i) {
    if (!samples_[i]) {
      const auto at = sample_places(boxes_[i].numel);
      OPTSTATE_ASSIGN_OR_RETURN(auto v, values_.box(i, at));
      if (v.size() != at.size()) return internal_error(where_ + ": a box's sample of another size");
      samples_[i] = std::move(v);
    }
    return &*samples_[i];
  }

  // Whether bucket b's main params at [begin, begin + numel) round to box i's weights everywhere.
  Result<bool> equal_everywhere(size_t b, int64_t begin, size_t i) {
    const Box& box = boxes_[i];
    if (static_cast<uint64_t>(box.numel) > compare_budget_)
      return corrupt(fmt::format("{}: placing the buckets' params compares more elements than the buckets hold "
                                 "several times over (chunks and weights made to match everywhere)",
                                 where_));
    compare_budget_ -= static_cast<uint64_t>(box.numel);
    std::vector<int64_t> at;
    for (int64_t from = 0; from < box.numel; from += kComparePiece) {
      const int64_t n = std::min(kComparePiece, box.numel - from);
      at.resize(static_cast<size_t>(n));
      for (int64_t k = 0; k < n; ++k) at[static_cast<size_t>(k)] = from + k;
      OPTSTATE_ASSIGN_OR_RETURN(auto mine, values_.bucket(b, begin, at, box.dtype));
      OPTSTATE_ASSIGN_OR_RETURN(auto theirs, values_.box(i, at));
      if (mine != theirs) return false;
    }
    return true;
  }

  // The runs of bucket b, from its first element on: at each chunk start not inside a run found,
  // the boxes whose size ends it at a chunk bound and whose sample its main params round to.
  Status find_runs(size_t b) {
    const Bucket& bk = buckets_[b];
    const auto& starts = bk.starts;
    if (starts.empty() || starts[0] != 0 || !std::is_sorted(starts.begin(), starts.end()) ||
        std::adjacent_find(starts.begin(), starts.end()) != starts.end() || starts.back() >= bk.numel)
      return corrupt(fmt::format("{}: {}'s chunks do not tile it", where_, bucket_name(b)));
    auto is_bound = [&](int64_t e) { return e == bk.numel || std::binary_search(starts.begin(), starts.end(), e); };
    int64_t covered = 0;
    for (const int64_t s : starts) {
      if (s < covered) continue;
      std::vector<Run> found;
      for (const auto& [n, ids] : by_numel_) {
        if (n > bk.numel - s) break;
        if (!is_bound(s + n)) continue;
        const auto at = sample_places(n);
        std::map<DType, std::vector<uint32_t>> mine;
        Run run{b, s, n, {}, false};
        for (const size_t i : ids) {
          auto m = mine.find(boxes_[i].dtype);
          if (m == mine.end()) {
            if (sample_budget_-- == 0)
              return corrupt(fmt::format("{}: {}'s chunk bounds admit too many runs to compare", where_, bucket_name(b)));
            OPTSTATE_ASSIGN_OR_RETURN(auto v, values_.bucket(b, s, at, boxes_[i].dtype));
            m = mine.emplace(boxes_[i].dtype, std::move(v)).first;
          }
          OPTSTATE_ASSIGN_OR_RETURN(const std::vector<uint32_t>* theirs, box_sample(i));
          if (*theirs == m->second) run.boxes.push_back(i);
        }
        if (!run.boxes.empty()) found.push_back(std::move(run));
      }
      // Several sizes, or several boxes of one: keep what matches at every element.
      if (found.size() > 1 || (found.size() == 1 && found[0].boxes.size() > 1)) {
        for (Run& r : found) {
          std::vector<size_t> kept;
          for (const size_t i : r.boxes) {
            OPTSTATE_ASSIGN_OR_RETURN(const bool eq, equal_everywhere(b, s, i));
            if (eq) kept.push_back(i);
          }
          r.boxes = std::move(kept);
          r.compared = true;
        }
        std::erase_if(found, [](const Run& r) { return r.boxes.empty(); });
      }
      if (found.empty()) continue;  // padding, or what no weight matches (check_padding)
      if (found.size() > 1)
        return unsupported(fmt::format("{}: the params at element {} of {} equal both {} ({} elements) and {} ({} "
                                       "elements): which one lies there is not in the checkpoint",
                                       where_, s, bucket_name(b), box_name(found[0].boxes[0]), found[0].numel,
                                       box_name(found[1].boxes[0]), found[1].numel));
      covered = s + found[0].numel;
      runs_.push_back(std::move(found[0]));
    }
    return Status::Ok();
  }

  // A box several runs of one domain hold (by their samples): kept only by those that hold it at
  // every element.
  Status settle_shared_boxes() {
    std::map<std::pair<size_t, size_t>, std::vector<size_t>> holders;  // (domain, box) -> runs
    for (size_t r = 0; r < runs_.size(); ++r)
      for (const size_t i : runs_[r].boxes) holders[{buckets_[runs_[r].bucket].domain, i}].push_back(r);
    for (const auto& [db, rs] : holders) {
      if (rs.size() < 2) continue;
      for (const size_t r : rs) {
        Run& run = runs_[r];
        if (run.compared) continue;
        OPTSTATE_ASSIGN_OR_RETURN(const bool eq, equal_everywhere(run.bucket, run.begin, db.second));
        if (!eq) std::erase(run.boxes, db.second);
      }
    }
    std::erase_if(runs_, [](const Run& r) { return r.boxes.empty(); });
    return Status::Ok();
  }

  // What no run takes of bucket b: Megatron's padding between params, shorter than its alignment.
  Status check_padding(size_t b) {
    const Bucket& bk = buckets_[b];
    int64_t at = 0;
    auto gap = [&](int64_t until) -> Status {
      if (until - at >= kParamAlignment)
        return unsupported(fmt::format("{}: elements [{}, {}) of {} hold the state of a param none of the model's "
                                       "weights in the checkpoint matches (the weights must be saved beside, as "
                                       "they were when the optimizer stepped)",
                                       where_, at, until, bucket_name(b)));
      return Status::Ok();
    };
    for (const Run& r : runs_) {
      if (r.bucket != b) continue;
      OPTSTATE_RETURN_IF_ERROR(gap(r.begin));
      at = r.begin + r.numel;
    }
    return gap(bk.numel);
  }

  Result<std::vector<std::optional<Placement>>> assign() {
    std::vector<std::optional<Placement>> out(boxes_.size());
    std::vector<size_t> placed_domain(boxes_.size(), SIZE_MAX);
    // per domain, the runs holding each set of equal boxes, in buffer order
    std::map<std::pair<size_t, std::vector<size_t>>, std::vector<size_t>> classes;
    for (size_t r = 0; r < runs_.size(); ++r)
      classes[{buckets_[runs_[r].bucket].domain, runs_[r].boxes}].push_back(r);
    for (const auto& [dc, rs] : classes) {
      const auto& [domain, ids] = dc;
      std::vector<size_t> order = ids;
      const int64_t buffer0 = buckets_[runs_[rs[0]].bucket].buffer;
      const bool one_buffer = std::all_of(rs.begin(), rs.end(),
                                          [&](size_t r) { return buckets_[runs_[r].bucket].buffer == buffer0; });
      if (ids.size() != rs.size() || (ids.size() > 1 && !(one_key(ids) && one_buffer))) {
        std::vector<std::string> which;
        for (const size_t i : ids) which.push_back(box_name(i));
        return unsupported(fmt::format("{}: {} run{} of the buffers of one rank hold the values of {} ({}), equal "
                                       "everywhere: which param's state each is, is not in the checkpoint",
                                       where_, rs.size(), rs.size() == 1 ? "" : "s", fmt::join(which, ", "),
                                       ids.size() == 1 ? "one weight"
                                       : one_key(ids)  ? "one key's, in different buffers"
                                                       : "weights of different keys or counts"));
      }
      // One key's equal boxes (layer norms still at their initial values): Megatron lays a
      // buffer's params out in reverse order of the model's, so its later layers come first.
      std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return boxes_[a].offsets > boxes_[b].offsets; });
      std::vector<size_t> runs = rs;
      std::sort(runs.begin(), runs.end(), [&](size_t a, size_t b) {
        return std::pair(runs_[a].bucket, runs_[a].begin) < std::pair(runs_[b].bucket, runs_[b].begin);
      });
      for (size_t k = 0; k < order.size(); ++k) {
        const size_t i = order[k];
        if (placed_domain[i] <= domain) continue;  // replicated: the first domain's
        placed_domain[i] = domain;
        out[i] = Placement{runs_[runs[k]].bucket, runs_[runs[k]].begin};
      }
    }
    // Every box of a weight, or none.
    std::map<size_t, std::pair<size_t, size_t>> per_key;  // key -> (boxes, placed)
    std::map<size_t, size_t> unplaced;
    for (size_t i = 0; i < boxes_.size(); ++i) {
      auto& [n, placed] = per_key[boxes_[i].key];
      ++n;
      if (out[i]) ++placed;
      else unplaced.emplace(boxes_[i].key, i);
    }
    for (const auto& [key, np] : per_key)
      if (np.second != 0 && np.second != np.first)
        return unsupported(fmt::format("{}: {} of the {} parts of '{}' lie in the optimizer's buffers, its part {} in "
                                       "none (stale weights, or a param frozen on some ranks only)",
                                       where_, np.second, np.first, names_[key], box_name(unplaced.at(key))));
    return out;
  }

  bool one_key(const std::vector<size_t>& ids) const {
    return std::all_of(ids.begin(), ids.end(), [&](size_t i) { return boxes_[i].key == boxes_[ids[0]].key; });
  }

  const std::vector<Bucket>& buckets_;
  const std::vector<Box>& boxes_;
  const std::vector<std::string>& names_;
  const BucketValues& values_;
  const std::string& where_;
  std::map<int64_t, std::vector<size_t>> by_numel_;
  std::vector<std::optional<std::vector<uint32_t>>> samples_;
  std::vector<Run> runs_;
  uint64_t sample_budget_ = 0, compare_budget_ = 0;
};

}  // namespace

Result<std::vector<std::optional<Placement>>> place_boxes(const std::vector<Bucket>& buckets,
                                                          const std::vector<Box>& boxes,
                                                          const std::vector<std::string>& names,
                                                          const BucketValues& values, const std::string& where) {
  return Placer(buckets, boxes, names, values, where).place();
}

}  // namespace optstate::dcp::megatron
