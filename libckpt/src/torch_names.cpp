#include "optstate/torch_names.h"

#include <fmt/format.h>

#include <algorithm>
#include <unordered_map>

namespace optstate {

std::string torch_param_fqn(std::string_view name, bool ddp_prefix) {
  if (ddp_prefix && name.substr(0, 7) == "module." && name.size() > 7) name.remove_prefix(7);
  std::string out;
  bool kept = false;
  for (size_t begin = 0; begin <= name.size();) {
    const size_t dot = std::min(name.find('.', begin), name.size());
    const std::string_view seg = name.substr(begin, dot - begin);
    if (seg != "_orig_mod" && seg != "_checkpoint_wrapped_module" && seg != "_fsdp_wrapped_module") {
      if (kept) out += '.';
      out += seg;
      kept = true;
    }
    begin = dot + 1;
  }
  return kept ? out : std::string(name);
}

ModelPlacement place_params_in_model(const std::vector<std::vector<std::optional<std::vector<int64_t>>>>& groups,
                                     const std::vector<std::vector<int64_t>>& tensors) {
  ModelPlacement out;
  const size_t k = groups.size(), c = tensors.size();
  size_t n = 0;
  for (const auto& g : groups) n += g.size();
  if (n > c) {
    out.why = fmt::format("its {} tensors are fewer than the optimizer's {} params", c, n);
    return out;
  }
  const size_t spare = c - n;  // tensors that are no param of the optimizer: buffers, frozen params
  // One group with params (the common case: model.parameters(), a LoRA's adapters): its leftmost
  // and rightmost placements bound every other, element by element, so it is unique exactly when
  // they are the same; found in two scans, whatever the number of spare tensors.
  size_t nonempty = 0, only = 0;
  for (size_t g = 0; g < k; ++g)
    if (!groups[g].empty()) ++nonempty, only = g;
  if (nonempty == 1) {
    const auto& params = groups[only];
    auto fits_one = [&](size_t i, size_t t) { return !params[i] || *params[i] == tensors[t]; };
    std::vector<size_t> left, right(params.size());
    for (size_t t = 0; t < c && left.size() < params.size(); ++t)
      if (fits_one(left.size(), t)) left.push_back(t);
    if (left.size() < params.size()) {
      out.why = fmt::format("the optimizer's {} params (in 1 group) are not among its {} tensors in order with their "
                            "shapes", n, c);
      return out;
    }
    size_t i = params.size();
    for (size_t t = c; t-- > 0 && i > 0;)
      if (fits_one(i - 1, t)) right[--i] = t;
    if (left != right) {
      out.why = fmt::format("the optimizer's {} params (in 1 group) fit among its {} tensors in more than one way "
                            "(buffers or frozen params shaped like params); which is which cannot be told", n, c);
      return out;
    }
    out.tensor_of.assign(k, {});
    out.tensor_of[only] = std::move(left);
    return out;
  }
  // Layer t: after the first t tensors, how many of each group's params are placed (the key) and in
  // how many ways (capped at 2: one or more than one is all that matters). Each tensor is either
  // the next param of a group whose next shape it has, or spare.
  using Key = std::vector<uint32_t>;
  struct KeyHash {
    size_t operator()(const Key& key) const noexcept {
      uint64_t h = 1469598103934665603ull;
      for (uint32_t v : key) h = (h ^ v) * 1099511628211ull;
      return static_cast<size_t>(h);
    }
  };
  auto fits = [&](size_t g, uint32_t i, size_t t) {
    const auto& s = groups[g][i];
    return !s || *s == tensors[t];
  };
  // A hostile file's model or groups must not make this run long or large: past this many key
  // elements held, or copied, the placement is given up as "too many ways".
  constexpr size_t kMaxCells = size_t{1} << 22, kMaxWork = size_t{1} << 26;
  size_t cells = k, work = 0;
  std::vector<std::vector<std::pair<Key, uint8_t>>> layers(c + 1);  // sorted, kept for the walk back
  layers[0].emplace_back(Key(k, 0), uint8_t{1});
  for (size_t t = 0; t < c; ++t) {
    std::unordered_map<Key, uint8_t, KeyHash> next;
    auto add = [&](Key key, uint8_t ways) {
      auto [it, fresh] = next.try_emplace(std::move(key), uint8_t{0});
      it->second = static_cast<uint8_t>(std::min(2, it->second + ways));
      if (fresh) cells += k + 1;
      work += k + 1;
    };
    for (const auto& [key, ways] : layers[t]) {
      if (work > kMaxWork) break;
      size_t placed = 0;
      for (uint32_t v : key) placed += v;
      if (t - placed < spare) add(key, ways);
      for (size_t g = 0; g < k; ++g)
        if (key[g] < groups[g].size() && fits(g, key[g], t)) {
          Key moved = key;
          ++moved[g];
          add(std::move(moved), ways);
        }
    }
    if (cells > kMaxCells || work > kMaxWork) {
      out.why = fmt::format("too many ways to place the optimizer's {} params among its {} tensors to try them all", n, c);
      return out;
    }
    layers[t + 1].assign(next.begin(), next.end());
    std::sort(layers[t + 1].begin(), layers[t + 1].end());
  }
  auto find = [&](size_t t, const Key& key) -> const uint8_t* {
    const auto& l = layers[t];
    auto it = std::lower_bound(l.begin(), l.end(), key, [](const auto& e, const Key& x) { return e.first < x; });
    return it != l.end() && it->first == key ? &it->second : nullptr;
  };
  Key key(k);
  for (size_t g = 0; g < k; ++g) key[g] = static_cast<uint32_t>(groups[g].size());
  const uint8_t* ways = find(c, key);
  if (!ways) {
    out.why = fmt::format("the optimizer's {} params (in {} group{}) are not among its {} tensors in order with their "
                          "shapes", n, k, k == 1 ? "" : "s", c);
    return out;
  }
  if (*ways > 1) {
    out.why = fmt::format("the optimizer's {} params (in {} group{}) fit among its {} tensors in more than one way "
                          "(buffers or frozen params shaped like params); which is which cannot be told", n, k,
                          k == 1 ? "" : "s", c);
    return out;
  }
  // One way: walk it back. The count is exact, so exactly one predecessor of each state is held.
  out.tensor_of.resize(k);
  for (size_t g = 0; g < k; ++g) out.tensor_of[g].resize(groups[g].size());
  for (size_t t = c; t-- > 0;) {
    size_t placed = 0;
    for (uint32_t v : key) placed += v;
    if (t >= placed && t - placed < spare && find(t, key)) continue;  // tensor t is spare
    bool found = false;
    for (size_t g = 0; g < k && !found; ++g) {
      if (key[g] == 0 || !fits(g, key[g] - 1, t)) continue;
      Key prev = key;
      --prev[g];
      if (find(t, prev)) {
        out.tensor_of[g][prev[g]] = t;
        key = std::move(prev);
        found = true;
      }
    }
    if (!found) {  // cannot happen: the count said one way leads here
      out.tensor_of.clear();
      out.why = "no placement could be traced back (an internal error)";
      return out;
    }
  }
  return out;
}

bool is_norm_buffer(std::string_view name) {
  const auto dot = name.rfind('.');
  const std::string_view last = dot == std::string_view::npos ? name : name.substr(dot + 1);
  return last == "running_mean" || last == "running_var" || last == "num_batches_tracked";
}

}  // namespace optstate
