#include "nanotron_layout.h"

#include <fmt/format.h>

#include <charconv>
#include <limits>

#include "json_strict.h"
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
  const nlohmann::json j = parse_json_strict(json.data(), json.data() + json.size(), duplicate);
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
