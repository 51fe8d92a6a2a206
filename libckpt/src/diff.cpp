#include "optstate/diff.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <fnmatch.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "optstate/values.h"

namespace optstate {

bool DiffReport::ok() const {
  if (!metadata.empty()) return false;
  for (const auto& e : entries)
    if (!e.ok()) return false;
  return true;
}

namespace {

// Hyperparameters equal, numbers within rtol (relative to b's).
bool same_hyper(const Hyperparameters& a, const Hyperparameters& b, double rtol) {
  auto near = [rtol](double x, double y) { return same_number(x, y) || std::fabs(x - y) <= rtol * std::fabs(y); };
  return near(a.lr, b.lr) && near(a.beta1, b.beta1) && near(a.beta2, b.beta2) && near(a.eps, b.eps) &&
         near(a.weight_decay, b.weight_decay) && a.amsgrad == b.amsgrad && a.maximize == b.maximize;
}

// Whether every param of the state is named by a number ("0", "1", ...), as a state_dict without
// names (a LibTorch archive) numbers them.
bool numbered_params(const OptimizerState& s) {
  bool numbered = !s.params.empty();
  for (const auto& [fqn, ps] : s.params)
    numbered = numbered && !fqn.empty() && fqn.size() <= 15 && fqn.find_first_not_of("0123456789") == std::string::npos &&
               (fqn == "0" || fqn[0] != '0');
  return numbered;
}

// Each param's position: its number where every param of the state is one (numbered_params), else
// its index in group order (as torch numbers params).
std::map<int64_t, std::string> positions(const OptimizerState& s) {
  std::map<int64_t, std::string> out;
  if (numbered_params(s)) {
    for (const auto& [fqn, ps] : s.params) out.emplace(std::stoll(fqn), fqn);
    return out;
  }
  int64_t i = 0;
  for (const ParamGroup& g : s.groups)
    for (const std::string& fqn : g.params)
      if (s.params.count(fqn)) out.emplace(i++, fqn);
  return out;
}

}  // namespace

Result<DiffReport> diff_checkpoints(CheckpointReader& a, CheckpointReader& b, const DiffOptions& options) {
  DiffReport r;
  const OptimizerState &ma = a.meta(), &mb = b.meta();
  if (ma.kind != mb.kind) r.metadata.push_back(fmt::format("optimizer kind: {} vs {}", ma.kind, mb.kind));
  // The pairs compared: (A's fqn, B's fqn), "" where a side has none; by name, or by position.
  std::vector<std::pair<std::string, std::string>> pairs;
  if (options.by_position) {
    const auto pa = positions(ma), pb = positions(mb);
    std::set<int64_t> at;
    for (const auto& [i, f] : pa) at.insert(i);
    for (const auto& [i, f] : pb) at.insert(i);
    for (int64_t i : at) {
      auto x = pa.find(i), y = pb.find(i);
      pairs.emplace_back(x == pa.end() ? "" : x->second, y == pb.end() ? "" : y->second);
    }
  } else {
    std::set<std::string> fqns;
    for (const auto& [f, _] : ma.params) fqns.insert(f);
    for (const auto& [f, _] : mb.params) fqns.insert(f);
    for (const std::string& f : fqns)
      pairs.emplace_back(ma.params.count(f) ? f : "", mb.params.count(f) ? f : "");
  }
  if (!options.params.empty()) {
    auto matches = [&](const std::string& fqn) { return !fqn.empty() && fnmatch(options.params.c_str(), fqn.c_str(), 0) == 0; };
    std::erase_if(pairs, [&](const auto& p) { return !matches(p.first) && !matches(p.second); });
    if (pairs.empty())
      return invalid_argument(fmt::format("no param of A ({}) or B ({}) matches '{}'", a.path().string(),
                                          b.path().string(), options.params));
  }
  if (!options.by_position && !ma.params.empty() && !mb.params.empty() &&
      std::none_of(pairs.begin(), pairs.end(), [](const auto& p) { return !p.first.empty() && !p.second.empty(); })) {
    const auto pa = positions(ma), pb = positions(mb);
    const bool na = numbered_params(ma), nb = numbered_params(mb);
    r.hint = fmt::format("no param of A is named as one of B's{}; --by-position matches them in group order, as torch "
                         "numbers them{}",
                         na == nb ? "" : fmt::format(" ({}'s params are numbered, as a state_dict without names keeps them)",
                                                     na ? "A" : "B"),
                         pa.size() == pb.size() ? "" : fmt::format(" (A has {} params, B {})", pa.size(), pb.size()));
  }
  auto label = [&](const std::pair<std::string, std::string>& p) {
    return options.by_position && p.first != p.second ? p.first + "=" + p.second : p.first;
  };
  // Hyperparameters are compared param by param, as the hash sees them (numbers within rtol: lr
  // kept as a float32 tensor, torchao's, is lr rounded to float32): how params are grouped
  // is not part of the state (a flattened DCP does not record it), what each param is trained
  // with is. Params with the same difference are reported together.
  std::map<std::pair<int, int>, std::vector<std::string>> differing;  // (group in A, group in B) -> fqns
  for (const auto& pair : pairs) {
    if (pair.first.empty() || pair.second.empty()) continue;
    const ParamState &pa = ma.params.at(pair.first), &pb = mb.params.at(pair.second);
    if (pa.group < 0 || pb.group < 0 || static_cast<size_t>(pa.group) >= ma.groups.size() ||
        static_cast<size_t>(pb.group) >= mb.groups.size())
      continue;
    if (!same_hyper(ma.groups[pa.group].hyper, mb.groups[pb.group].hyper, options.rtol))
      differing[{pa.group, pb.group}].push_back(label(pair));
  }
  for (const auto& [gg, fqns] : differing) {
    const Hyperparameters &x = ma.groups[gg.first].hyper, &y = mb.groups[gg.second].hyper;
    std::vector<std::string> shown(fqns.begin(), fqns.begin() + static_cast<long>(std::min<size_t>(fqns.size(), 3)));
    r.metadata.push_back(fmt::format("hyperparameters of {} param(s) ('{}'{}): lr {} vs {}, betas ({}, {}) vs ({}, {}), "
                                     "eps {} vs {}, weight_decay {} vs {}, amsgrad {} vs {}, maximize {} vs {}",
                                     fqns.size(), fmt::join(shown, "', '"), fqns.size() > 3 ? ", ..." : "", x.lr,
                                     y.lr, x.beta1, x.beta2, y.beta1, y.beta2, x.eps, y.eps, x.weight_decay,
                                     y.weight_decay, x.amsgrad, y.amsgrad, x.maximize, y.maximize));
  }
  for (const auto& pair : pairs) {
    const std::string fqn = label(pair);
    if (pair.first.empty() || pair.second.empty()) {
      // Optimizer state only: a param with nothing but weights (never stepped) is not part of it.
      const ParamState& only = pair.first.empty() ? mb.params.at(pair.second) : ma.params.at(pair.first);
      if (options.no_weights && only.entries.size() == only.entries.count(kParam)) continue;
      r.metadata.push_back(fmt::format("param '{}' only in {}{}", pair.first.empty() ? pair.second : pair.first,
                                       pair.first.empty() ? "B" : "A", options.by_position ? " (by position)" : ""));
      continue;
    }
    auto pa = ma.params.find(pair.first), pb = mb.params.find(pair.second);
    if (pa->second.step != pb->second.step)
      r.metadata.push_back(fmt::format("param '{}' step: {} vs {}", fqn, pa->second.step, pb->second.step));
    if (!options.no_weights && pa->second.param_dtype != pb->second.param_dtype)
      r.metadata.push_back(fmt::format("param '{}' dtype: {} vs {}", fqn, dtype_name(pa->second.param_dtype),
                                       dtype_name(pb->second.param_dtype)));
    std::set<std::string> names;
    for (const auto& [n, _] : pa->second.entries) names.insert(n);
    for (const auto& [n, _] : pb->second.entries) names.insert(n);
    if (options.no_weights) names.erase(kParam);
    for (const std::string& name : names) {
      EntryDiff d;
      d.key = entry_key(fqn, name);
      const bool in_a = pa->second.entries.count(name), in_b = pb->second.entries.count(name);
      if (!in_a || !in_b) {
        d.problem = fmt::format("only in {}", in_a ? "A" : "B");
      } else if (pa->second.shape != pb->second.shape) {
        d.problem = fmt::format("shape {} vs {}", format_shape(pa->second.shape), format_shape(pb->second.shape));
      } else {
        // One entry of A in memory at a time; B streams against it.
        std::vector<float> va;
        OPTSTATE_RETURN_IF_ERROR(stream_f32_values(a, pair.first, name, [&](std::span<const float> v) {
          va.insert(va.end(), v.begin(), v.end());
          return Status::Ok();
        }));
        size_t at = 0;
        OPTSTATE_RETURN_IF_ERROR(stream_f32_values(b, pair.second, name, [&](std::span<const float> v) {
          if (at + v.size() > va.size()) return corrupt(fmt::format("entry '{}' has more values in B", d.key));
          for (float y : v) {
            const float x = va[at++];
            const double ad = std::fabs(static_cast<double>(x) - y);
            const bool same_nan = std::isnan(x) && std::isnan(y);
            const bool same_inf = std::isinf(x) && x == y;
            if (same_nan || same_inf) continue;
            const double rel = ad / std::max(std::fabs(static_cast<double>(y)), 1e-30);
            d.max_abs = std::isnan(ad) ? INFINITY : std::max(d.max_abs, ad);
            d.max_rel = std::isnan(rel) ? INFINITY : std::max(d.max_rel, rel);
            if (!(ad <= options.atol + options.rtol * std::fabs(static_cast<double>(y)))) ++d.outside;
          }
          return Status::Ok();
        }));
        d.count = static_cast<int64_t>(at);
        if (at != va.size()) return corrupt(fmt::format("entry '{}' has fewer values in B", d.key));
      }
      r.entries.push_back(std::move(d));
    }
  }
  return r;
}

}  // namespace optstate
