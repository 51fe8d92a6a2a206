#include "nanotron_layout.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <limits>

#include "optstate/json_strict.h"
#include "optstate/state.h"  // checked_numel

namespace optstate::nanotron {

namespace {

constexpr int64_t kMaxSize = int64_t{1} << 20;  // ranks of a parallel dim, dims of a shape

// A run of decimal digits (no sign, no leading '+'), as a value below 2^62.
std::optional<int64_t> digits(std::string_view s) {
  if (s.empty() || s.size() > 18) return std::nullopt;
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || v < 0) return std::nullopt;
  return v;
}

// "<key>-<i>-of-<n>" at the front of `s`, consumed.
std::optional<std::pair<int64_t, int64_t>> rank_of(std::string_view& s, std::string_view key) {
  if (!s.starts_with(key) || s.size() <= key.size() || s[key.size()] != '-') return std::nullopt;
  s.remove_prefix(key.size() + 1);
  const size_t of = s.find("-of-");
  if (of == std::string_view::npos) return std::nullopt;
  const auto i = digits(s.substr(0, of));
  s.remove_prefix(of + 4);
  size_t n_end = 0;
  while (n_end < s.size() && s[n_end] >= '0' && s[n_end] <= '9') ++n_end;
  const auto n = digits(s.substr(0, n_end));
  s.remove_prefix(n_end);
  if (!i || !n || *n < 1 || *n > kMaxSize || *i >= *n) return std::nullopt;
  return std::pair{*i, *n};
}

// A size or offset nanotron wrote as a string of digits (or a JSON number).
std::optional<int64_t> count_of(const nlohmann::json& j) {
  if (j.is_string()) return digits(j.get<std::string>());
  if (j.is_number_unsigned()) {
    const auto v = j.get<uint64_t>();
    if (v <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max() / 4)) return static_cast<int64_t>(v);
  }
  if (j.is_number_integer() && j.get<int64_t>() >= 0) return j.get<int64_t>();
  return std::nullopt;
}

}  // namespace

std::optional<FileRanks> parse_file_name(std::string_view name) {
  if (!name.starts_with("optimizer_") || !name.ends_with(".pt")) return std::nullopt;
  name.remove_prefix(10);
  name.remove_suffix(3);
  FileRanks r;
  const auto pp = rank_of(name, "pp");
  if (!pp) return std::nullopt;
  std::tie(r.pp, r.pp_size) = *pp;
  if (!name.starts_with('_')) return std::nullopt;
  name.remove_prefix(1);
  if (name.starts_with("dp-")) {
    const auto dp = rank_of(name, "dp");
    if (!dp || !name.starts_with('_')) return std::nullopt;
    r.dp = dp->first;
    r.dp_size = dp->second;
    name.remove_prefix(1);
  }
  const auto tp = rank_of(name, "tp");
  if (!tp) return std::nullopt;
  std::tie(r.tp, r.tp_size) = *tp;
  if (name.starts_with("_exp-")) {
    name.remove_prefix(1);
    const auto exp = rank_of(name, "exp");
    if (!exp) return std::nullopt;
    std::tie(r.exp, r.exp_size) = *exp;
  }
  if (!name.empty()) return std::nullopt;
  return r;
}

Result<Config> parse_config(std::string_view json, const std::string& where) {
  std::optional<std::string> duplicate;
  std::string refused;
  const nlohmann::json j = parse_json_strict(json.data(), json.data() + json.size(), duplicate, refused);
  if (!refused.empty()) return corrupt(fmt::format("{}: JSON {}", where, refused));
  if (j.is_discarded() || !j.is_object()) return corrupt(where + ": not a JSON object");
  if (duplicate) return corrupt(fmt::format("{}: key '{}' twice in one object", where, *duplicate));
  Config c;
  const auto type = j.find("type");
  if (type == j.end() || !type->is_string() || type->get<std::string>().empty())
    return corrupt(where + ": no 'type' (the optimizer's class)");
  c.type = type->get<std::string>();
  const auto par = j.find("parallelism");
  if (par == j.end() || !par->is_object()) return corrupt(where + ": no 'parallelism' object");
  for (auto [key, out] : {std::pair{"tp_size", &c.tp_size}, std::pair{"dp_size", &c.dp_size},
                          std::pair{"pp_size", &c.pp_size}, std::pair{"expert_parallel_size", &c.exp_size}}) {
    const auto v = par->find(key);
    if (v == par->end()) {
      if (std::string_view(key) == "expert_parallel_size") continue;  // before nanotron's MoE
      return corrupt(fmt::format("{}: parallelism has no '{}'", where, key));
    }
    const auto n = count_of(*v);
    if (!n || *n < 1 || *n > kMaxSize)
      return corrupt(fmt::format("{}: parallelism '{}' is not a size in [1, {}]", where, key, kMaxSize));
    *out = *n;
  }
  const auto configs = j.find("configs");
  if (configs != j.end() && !configs->is_object()) return corrupt(where + ": 'configs' is not an object");
  if (!c.is_zero()) return c;
  if (configs == j.end()) return corrupt(where + ": ZeroDistributedOptimizer without 'configs'");
  const auto offsets = configs->find("param_name_to_dp_rank_offsets");
  const auto shapes = configs->find("orig_param_shapes");
  if (offsets == configs->end() || !offsets->is_object() || shapes == configs->end() || !shapes->is_object())
    return corrupt(where + ": ZeroDistributedOptimizer without 'param_name_to_dp_rank_offsets' and "
                           "'orig_param_shapes' objects");
  for (const auto& [name, dims] : shapes->items()) {
    const std::string pw = fmt::format("{}: orig_param_shapes '{}'", where, name);
    if (name.empty()) return corrupt(where + ": orig_param_shapes has an empty name");
    if (!dims.is_array() || dims.size() > 16) return corrupt(pw + ": not a list of at most 16 sizes");
    Config::ZeroParam& zp = c.zero[name];
    for (const auto& d : dims) {
      const auto n = count_of(d);
      if (!n) return corrupt(pw + ": a size is not a count");
      zp.shape.push_back(*n);
    }
    if (!checked_numel(zp.shape).ok()) return corrupt(pw + ": its elements overflow");
  }
  for (const auto& [name, ranks] : offsets->items()) {
    const std::string pw = fmt::format("{}: param_name_to_dp_rank_offsets '{}'", where, name);
    const auto zp = c.zero.find(name);
    if (zp == c.zero.end()) return corrupt(pw + ": no orig_param_shapes of it");
    if (!ranks.is_object()) return corrupt(pw + ": not an object of data-parallel ranks");
    const int64_t numel = *checked_numel(zp->second.shape);
    for (const auto& [rank, run] : ranks.items()) {
      const auto dp = digits(rank);
      if (!dp || *dp >= c.dp_size) return corrupt(fmt::format("{}: '{}' is not a rank below dp_size {}", pw, rank, c.dp_size));
      std::optional<int64_t> start, end;
      if (run.is_array() && run.size() == 2) start = count_of(run[0]), end = count_of(run[1]);
      if (!start || !end || *start >= *end || *end > numel)
        return corrupt(fmt::format("{}: rank {}'s run is not [start, end) inside its {} elements", pw, *dp, numel));
      zp->second.runs.emplace(*dp, std::pair{*start, *end});
    }
  }
  for (const auto& [name, zp] : c.zero)
    if (zp.runs.empty() && *checked_numel(zp.shape) > 0)
      return corrupt(fmt::format("{}: '{}' has a shape but no param_name_to_dp_rank_offsets", where, name));
  return c;
}

std::optional<ModelFile> parse_model_path(const std::vector<std::string>& components) {
  if (components.size() < 2) return std::nullopt;
  std::string_view file = components.back();
  if (!file.starts_with("model_") || !file.ends_with(".safetensors")) return std::nullopt;
  file.remove_prefix(6);
  file.remove_suffix(12);
  ModelFile m;
  const size_t ranks = file.find("_pp-rank-");
  std::string_view tensor = file.substr(0, ranks);
  if (ranks != std::string_view::npos) {
    std::string_view r = file.substr(ranks + 1);
    const auto pp = rank_of(r, "pp-rank");
    if (!pp || !r.starts_with('_')) return std::nullopt;
    r.remove_prefix(1);
    const auto tp = rank_of(r, "tp-rank");
    if (!tp) return std::nullopt;
    if (r.starts_with("_exp-rank-")) {
      r.remove_prefix(1);
      if (!rank_of(r, "exp-rank")) return std::nullopt;
    }
    if (!r.empty()) return std::nullopt;
    m.sharded = true;
    std::tie(m.pp, m.pp_size) = *pp;
    std::tie(m.tp, m.tp_size) = *tp;
  }
  if (tensor.empty()) return std::nullopt;
  for (size_t i = 0; i + 1 < components.size(); ++i) {
    if (components[i].empty() || components[i].find('.') != std::string::npos) return std::nullopt;
    m.name += components[i] + ".";
  }
  m.name += tensor;
  return m;
}

namespace {

// "None" or an integer (a sign allowed: Python slices take negative bounds, refused by the caller).
std::optional<std::optional<int64_t>> slice_bound(std::string_view s) {
  if (s == "None") return std::optional<int64_t>{};
  const bool negative = s.starts_with('-');
  const auto v = digits(negative ? s.substr(1) : s);
  if (!v) return std::nullopt;
  return std::optional<int64_t>{negative ? -*v : *v};
}

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  for (size_t at = 0;;) {
    const size_t next = s.find(sep, at);
    out.push_back(s.substr(at, next == std::string_view::npos ? std::string_view::npos : next - at));
    if (next == std::string_view::npos) return out;
    at = next + 1;
  }
}

std::optional<std::vector<Slice>> slices_of(std::string_view dims) {
  std::vector<Slice> out;
  for (std::string_view d : split(dims, '|')) {
    const auto parts = split(d, ',');
    if (parts.size() != 3) return std::nullopt;
    Slice sl;
    for (auto [part, bound] : {std::pair{parts[0], &sl.start}, std::pair{parts[1], &sl.stop},
                               std::pair{parts[2], &sl.step}}) {
      const auto b = slice_bound(part);
      if (!b) return std::nullopt;
      *bound = *b;
    }
    out.push_back(sl);
  }
  return out;
}

// A box's [begin, end) in a dim of `size`: step 1 only, bounds inside.
std::optional<std::pair<int64_t, int64_t>> box_dim(const Slice& s, int64_t size) {
  if (s.step && *s.step != 1) return std::nullopt;
  const int64_t begin = s.start.value_or(0), end = s.stop.value_or(size);
  if (begin < 0 || end > size || begin > end) return std::nullopt;
  return std::pair{begin, end};
}

}  // namespace

Result<ShardMeta> parse_shard_metadata(const std::map<std::string, std::string>& metadata, const std::string& where) {
  const auto pairs = metadata.find("local_global_slices_pairs");
  const auto unsharded = metadata.find("unsharded_shape");
  if (pairs == metadata.end() || unsharded == metadata.end())
    return corrupt(where + ": a sharded param's file without local_global_slices_pairs and unsharded_shape metadata");
  ShardMeta m;
  std::string_view u = unsharded->second;
  if (!u.starts_with('(') || !u.ends_with(')')) return corrupt(where + ": unsharded_shape is not a tuple");
  u = u.substr(1, u.size() - 2);
  for (std::string_view d : split(u, ',')) {
    while (d.starts_with(' ')) d.remove_prefix(1);
    if (d.empty() && m.unsharded.size() == 1) break;  // "(16,)": a one-element tuple
    if (d.starts_with("np.int64(") && d.ends_with(')')) d = d.substr(9, d.size() - 10);
    const auto v = digits(d);
    if (!v || m.unsharded.size() >= 16) return corrupt(where + ": unsharded_shape is not a tuple of sizes");
    m.unsharded.push_back(*v);
  }
  if (!checked_numel(m.unsharded).ok()) return corrupt(where + ": unsharded_shape's elements overflow");
  for (std::string_view pair : split(pairs->second, ';')) {
    const auto sides = split(pair, '#');
    std::optional<std::vector<Slice>> local, global;
    if (sides.size() == 2) local = slices_of(sides[0]), global = slices_of(sides[1]);
    if (!local || !global || m.pairs.size() >= 1024)
      return corrupt(where + ": local_global_slices_pairs is not pairs of 'start,stop,step|...#start,stop,step|...'");
    m.pairs.push_back({std::move(*local), std::move(*global)});
  }
  return m;
}

Result<std::vector<Run>> shard_runs(const std::vector<int64_t>& local_shape, const ShardMeta& meta, size_t max_runs,
                                    const std::string& where) {
  const size_t rank = local_shape.size();
  if (rank == 0 || meta.unsharded.size() != rank)
    return corrupt(fmt::format("{}: a local tensor of {} dims, unsharded_shape of {}", where, rank, meta.unsharded.size()));
  OPTSTATE_ASSIGN_OR_RETURN(const int64_t local_numel, checked_numel(local_shape));
  std::vector<Run> runs;
  for (const SlicePair& pair : meta.pairs) {
    if (pair.local.size() != rank || pair.global.size() != rank)
      return corrupt(fmt::format("{}: a slice pair of {} and {} dims for a tensor of {}", where, pair.local.size(),
                                 pair.global.size(), rank));
    std::vector<std::pair<int64_t, int64_t>> lb(rank), gb(rank);
    for (size_t d = 0; d < rank; ++d) {
      const auto l = box_dim(pair.local[d], local_shape[d]), g = box_dim(pair.global[d], meta.unsharded[d]);
      if (!l || !g || l->second - l->first != g->second - g->first)
        return corrupt(fmt::format("{}: a slice pair whose dim {} is not one box of the same size in the local "
                                   "tensor ({}) and the whole one ({})", where, d, local_shape[d], meta.unsharded[d]));
      lb[d] = *l;
      gb[d] = *g;
    }
    bool empty = false;
    for (const auto& [b, e] : lb) empty = empty || b == e;
    if (empty) continue;
    // Row by row along the last dim: the index of every leading dim, counted like an odometer.
    std::vector<int64_t> at(rank, 0);
    for (size_t d = 0; d < rank; ++d) at[d] = lb[d].first;
    const int64_t width = lb[rank - 1].second - lb[rank - 1].first;
    while (true) {
      int64_t local = 0, global = 0;
      for (size_t d = 0; d < rank; ++d) {
        local = local * local_shape[d] + at[d];
        global = global * meta.unsharded[d] + (at[d] - lb[d].first + gb[d].first);
      }
      Run& last = runs.empty() ? runs.emplace_back(Run{local, global, 0}) : runs.back();
      if (last.local + last.count == local && last.global + last.count == global) {
        last.count += width;
      } else {
        if (runs.size() >= max_runs)
          return corrupt(fmt::format("{}: more than {} runs of elements between the shards", where, max_runs));
        runs.push_back({local, global, width});
      }
      int d = static_cast<int>(rank) - 2;  // the next row: the leading dims' index advanced
      for (; d >= 0; --d) {
        if (++at[static_cast<size_t>(d)] < lb[static_cast<size_t>(d)].second) break;
        at[static_cast<size_t>(d)] = lb[static_cast<size_t>(d)].first;
      }
      if (d < 0) break;  // every row done
    }
  }
  std::vector<Run> by_local = runs;
  std::sort(by_local.begin(), by_local.end(), [](const Run& a, const Run& b) { return a.local < b.local; });
  int64_t covered = 0;
  for (const Run& r : by_local) {
    if (r.local != covered)
      return corrupt(fmt::format("{}: its slice pairs place element {} of the local tensor {} (next: {})", where,
                                 std::min(r.local, covered), r.local < covered ? "twice" : "nowhere", r.local));
    covered += r.count;
  }
  if (covered != local_numel)
    return corrupt(fmt::format("{}: its slice pairs place {} of the local tensor's {} elements", where, covered, local_numel));
  return by_local;
}

std::map<int64_t, std::pair<int64_t, int64_t>> zero_runs(int64_t numel, int64_t dp) {
  std::map<int64_t, std::pair<int64_t, int64_t>> out;
  if (numel <= 0 || dp <= 0) return out;
  const int64_t per = (numel - 1) / dp + 1, remainder = per * dp - numel;
  int64_t at = 0;
  for (int64_t r = 0; r < dp; ++r) {
    const int64_t n = per - (r >= dp - remainder ? 1 : 0);
    if (n > 0) out.emplace(r, std::pair{at, at + n});
    at += n;
  }
  return out;
}

}  // namespace optstate::nanotron
