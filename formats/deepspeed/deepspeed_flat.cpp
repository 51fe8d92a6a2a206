#include "deepspeed_flat.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>
#include <tuple>
#include <utility>

#include "dcp/megatron_buckets.h"  // sample_places

namespace optstate::deepspeed {

Result<std::vector<std::optional<FlatPlace>>> place_in_flat_groups(const std::vector<int64_t>& group_numels,
                                                                   const std::vector<int64_t>& numels,
                                                                   const std::vector<std::string>& names,
                                                                   const FlatValues& values, const std::string& where,
                                                                   const std::vector<int>& classes, int64_t max_visits) {
  const size_t groups = group_numels.size(), tensors = numels.size();
  if (names.size() != tensors || (!classes.empty() && classes.size() != tensors))
    return internal_error(where + ": a name (and class) per tensor is needed");
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  int64_t total = 0;
  for (size_t g = 0; g < groups; ++g) {
    if (group_numels[g] < 0 || group_numels[g] > kMax - total)
      return corrupt(fmt::format("{}: param group {}'s flat master has {} elements", where, g, group_numels[g]));
    total += group_numels[g];
  }
  // suffix[t]: the elements tensors t.. hold (saturated): more room left than that is a dead end
  std::vector<int64_t> suffix(tensors + 1, 0);
  for (size_t t = tensors; t-- > 0;) {
    if (numels[t] < 0) return internal_error(fmt::format("{}: '{}' has {} elements", where, names[t], numels[t]));
    suffix[t] = numels[t] > kMax - suffix[t + 1] ? kMax : suffix[t + 1] + numels[t];
  }

  std::map<std::tuple<size_t, int64_t, size_t>, bool> compared;  // (group, begin, tensor) -> fits
  auto fits = [&](size_t g, int64_t begin, size_t t) -> Result<bool> {
    const auto key = std::tuple{g, begin, t};
    if (auto it = compared.find(key); it != compared.end()) return it->second;
    const std::vector<int64_t> at = dcp::megatron::sample_places(numels[t]);
    OPTSTATE_ASSIGN_OR_RETURN(const auto master, values.flat(g, begin, at, t));
    OPTSTATE_ASSIGN_OR_RETURN(const auto weights, values.tensor(t, at));
    const bool same = master == weights;
    compared.emplace(key, same);
    return same;
  };
  // The tensors by class and first element; per (group, element) the tensors that fit there.
  std::map<int, size_t> first_of_class;                           // class -> a tensor of it
  std::map<std::pair<int, uint32_t>, std::vector<size_t>> by_first;  // (class, first element) -> tensors, ascending
  for (size_t t = 0; t < tensors; ++t) {
    if (numels[t] == 0) continue;
    const int c = classes.empty() ? 0 : classes[t];
    first_of_class.try_emplace(c, t);
    const int64_t zero = 0;
    OPTSTATE_ASSIGN_OR_RETURN(const auto first, values.tensor(t, std::span(&zero, 1)));
    if (first.size() != 1) return internal_error(where + ": one value asked, another count given");
    by_first[{c, first[0]}].push_back(t);
  }
  std::map<std::pair<size_t, int64_t>, std::vector<size_t>> fitting;  // (group, element) -> tensors, ascending
  auto fit_at = [&](size_t g, int64_t begin) -> Result<const std::vector<size_t>*> {
    const auto key = std::pair{g, begin};
    if (auto it = fitting.find(key); it != fitting.end()) return &it->second;
    std::vector<size_t> out;
    const int64_t zero = 0;
    for (const auto& [c, rep] : first_of_class) {
      OPTSTATE_ASSIGN_OR_RETURN(const auto master, values.flat(g, begin, std::span(&zero, 1), rep));
      if (master.size() != 1) return internal_error(where + ": one value asked, another count given");
      const auto cands = by_first.find({c, master[0]});
      if (cands == by_first.end()) continue;
      for (const size_t t : cands->second) {
        if (numels[t] > group_numels[g] - begin) continue;
        OPTSTATE_ASSIGN_OR_RETURN(const bool yes, fits(g, begin, t));
        if (yes) out.push_back(t);
      }
    }
    std::sort(out.begin(), out.end());
    return &fitting.emplace(key, std::move(out)).first->second;
  };

  // A backtracking walk over the tensors in module order: each placed at its group's fill (where it
  // fits) or left out, group by group first; a (tensor, fill) state is walked once (`seen`: whether
  // it led to a placement), so a second path into a state that led to one is a second placement.
  // Each state kept holds a fill per group: the states walked are capped so that they hold at most
  // 2^26 fills (a hostile file may list thousands of groups).
  const int64_t state_cap = std::min<int64_t>(max_visits, std::max<int64_t>(1, (int64_t{1} << 26) /
                                                                                std::max<int64_t>(1, static_cast<int64_t>(groups))));
  const int skip = static_cast<int>(groups);
  std::vector<int64_t> fill(groups, 0);
  int64_t room = total;
  std::vector<int> option(tensors, -1);  // at tensor t: the group it is in, or `skip`
  std::vector<size_t> found_before(tensors, 0);
  std::map<std::pair<size_t, std::vector<int64_t>>, bool> seen;
  size_t found = 0;
  std::vector<int> first, second;  // the placements found: per tensor its group, or -1
  int64_t least_room = total;
  std::vector<int64_t> fullest = fill;
  int64_t visits = 0;
  auto assignment = [&](size_t upto) {
    std::vector<int> a(tensors, -1);
    for (size_t i = 0; i < upto; ++i) a[i] = option[i] < skip ? option[i] : -1;
    return a;
  };
  size_t t = 0;
  bool enter = true;
  while (true) {
    bool back = false;
    if (enter) {
      enter = false;
      if (room < least_room) {
        least_room = room;
        fullest = fill;
      }
      if (room == 0) {  // every group filled: the tensors after t are in none
        (++found == 1 ? first : second) = assignment(t);
        back = true;
      } else if (t == tensors || room > suffix[t]) {
        back = true;
      } else if (auto it = seen.find({t, fill}); it != seen.end()) {
        if (it->second && ++found == 2) second = assignment(t);
        back = true;
      } else {
        // a group whose next element no tensor left fits at: no way on from here
        for (size_t g = 0; g < groups && !back; ++g) {
          if (fill[g] == group_numels[g]) continue;
          OPTSTATE_ASSIGN_OR_RETURN(const auto* here, fit_at(g, fill[g]));
          back = std::lower_bound(here->begin(), here->end(), t) == here->end();
        }
        if (back) seen[{t, fill}] = false;
      }
      if (!back) {
        if (++visits > state_cap)
          return corrupt(fmt::format("{}: no placement of the model's tensors in the flat masters found after {} "
                                     "steps (too many tensors of equal weights, or {} param groups)", where, state_cap,
                                     groups));
        found_before[t] = found;
        option[t] = -1;
      }
    }
    if (found >= 2) break;
    if (!back) {
      int& k = option[t];
      if (k >= 0 && k < skip) {
        fill[static_cast<size_t>(k)] -= numels[t];
        room += numels[t];
      }
      bool moved = false;
      for (++k; k <= skip && !moved; ++k) {
        if (k == skip) {
          moved = true;
          break;
        }
        const size_t g = static_cast<size_t>(k);
        if (numels[t] == 0 || numels[t] > group_numels[g] - fill[g]) continue;
        OPTSTATE_ASSIGN_OR_RETURN(const bool yes, fits(g, fill[g], t));
        if (yes) {
          fill[g] += numels[t];
          room -= numels[t];
          moved = true;
          break;
        }
      }
      if (moved) {
        ++t;
        enter = true;
        continue;
      }
      seen[{t, fill}] = found > found_before[t];  // every way on from here walked
    }
    if (t == 0) break;
    --t;
  }

  if (found == 0) {
    // the fullest state's group whose next element no tensor fits at, else its first unfilled one
    size_t g = groups;
    for (size_t h = 0; h < groups && g == groups; ++h) {
      if (fullest[h] == group_numels[h]) continue;
      OPTSTATE_ASSIGN_OR_RETURN(const auto* here, fit_at(h, fullest[h]));
      if (here->empty()) g = h;
    }
    for (size_t h = 0; h < groups && g == groups; ++h)
      if (fullest[h] != group_numels[h]) g = h;
    if (g == groups) return internal_error(where + ": no placement, every group filled");
    return corrupt(fmt::format(
        "{}: param group {}'s flat master ({} elements) holds no model tensor at element {} (the group's params are "
        "found in module order where the master rounds to the module's weights; none of the {} tensors there fits "
        "after the ones before it: params given to the optimizer out of module order, or weights and optimizer of "
        "different steps)", where, g, group_numels[g], fullest[g], tensors));
  }
  if (found >= 2) {
    size_t i = 0;
    while (i < tensors && first[i] == second[i]) ++i;
    if (i == tensors) return internal_error(where + ": two placements alike");
    auto in = [&](int g) { return g < 0 ? std::string("in no group") : fmt::format("in param group {}", g); };
    return corrupt(fmt::format("{}: the model's tensors fit the flat masters in more than one way ('{}' {} or {}: "
                               "tensors of equal weights, as before the first step); which param's state is which "
                               "cannot be told", where, names[i], in(first[i]), in(second[i])));
  }
  std::vector<std::optional<FlatPlace>> out(tensors);
  std::vector<int64_t> at(groups, 0);
  for (size_t i = 0; i < tensors; ++i)
    if (first[i] >= 0) {
      const size_t g = static_cast<size_t>(first[i]);
      out[i] = FlatPlace{g, at[g]};
      at[g] += numels[i];
    }
  return out;
}

}  // namespace optstate::deepspeed
