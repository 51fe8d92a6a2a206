#include "optstate/diff.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

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

Result<DiffReport> diff_checkpoints(CheckpointReader& a, CheckpointReader& b, const DiffOptions& options) {
  DiffReport r;
  const OptimizerState &ma = a.meta(), &mb = b.meta();
  if (ma.kind != mb.kind) r.metadata.push_back(fmt::format("optimizer kind: {} vs {}", ma.kind, mb.kind));
  // Hyperparameters are compared param by param, as the hash sees them: how params are grouped
  // is not part of the state (a flattened DCP does not record it), what each param is trained
  // with is. Params with the same difference are reported together.
  std::map<std::pair<int, int>, std::vector<std::string>> differing;  // (group in A, group in B) -> fqns
  for (const auto& [fqn, pa] : ma.params) {
    auto pb = mb.params.find(fqn);
    if (pb == mb.params.end() || pa.group < 0 || pb->second.group < 0 ||
        static_cast<size_t>(pa.group) >= ma.groups.size() || static_cast<size_t>(pb->second.group) >= mb.groups.size())
      continue;
    if (!(ma.groups[pa.group].hyper == mb.groups[pb->second.group].hyper))
      differing[{pa.group, pb->second.group}].push_back(fqn);
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
  std::set<std::string> fqns;
  for (const auto& [f, _] : ma.params) fqns.insert(f);
  for (const auto& [f, _] : mb.params) fqns.insert(f);
  for (const std::string& fqn : fqns) {
    auto pa = ma.params.find(fqn), pb = mb.params.find(fqn);
    if (pa == ma.params.end() || pb == mb.params.end()) {
      r.metadata.push_back(fmt::format("param '{}' only in {}", fqn, pa == ma.params.end() ? "B" : "A"));
      continue;
    }
    if (pa->second.step != pb->second.step)
      r.metadata.push_back(fmt::format("param '{}' step: {} vs {}", fqn, pa->second.step, pb->second.step));
    if (pa->second.param_dtype != pb->second.param_dtype)
      r.metadata.push_back(fmt::format("param '{}' dtype: {} vs {}", fqn, dtype_name(pa->second.param_dtype),
                                       dtype_name(pb->second.param_dtype)));
    std::set<std::string> names;
    for (const auto& [n, _] : pa->second.entries) names.insert(n);
    for (const auto& [n, _] : pb->second.entries) names.insert(n);
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
        OPTSTATE_RETURN_IF_ERROR(stream_f32_values(a, fqn, name, [&](std::span<const float> v) {
          va.insert(va.end(), v.begin(), v.end());
          return Status::Ok();
        }));
        size_t at = 0;
        OPTSTATE_RETURN_IF_ERROR(stream_f32_values(b, fqn, name, [&](std::span<const float> v) {
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
