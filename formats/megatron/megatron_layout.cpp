#include "megatron_layout.h"

#include <fmt/format.h>

#include <charconv>

#include "dcp/megatron_buckets.h"  // sample_places

namespace optstate::megatron {

namespace {

std::optional<int64_t> digits(std::string_view s, size_t min_width) {
  if (s.size() < min_width || s.size() > 9) return std::nullopt;
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || s.find_first_not_of("0123456789") != std::string_view::npos)
    return std::nullopt;
  return v;
}

// The name's last two segments: its module's and its own (linear_fc1, weight).
std::pair<std::string_view, std::string_view> last_two(std::string_view name) {
  const size_t dot = name.rfind('.');
  if (dot == std::string_view::npos) return {{}, name};
  const std::string_view leaf = name.substr(dot + 1), rest = name.substr(0, dot);
  const size_t dot2 = rest.rfind('.');
  return {dot2 == std::string_view::npos ? rest : rest.substr(dot2 + 1), leaf};
}

// weight, or TEGroupedMLP's weight<k> (one per local expert)
bool is_weight(std::string_view leaf) {
  if (!leaf.starts_with("weight")) return false;
  return leaf.size() == 6 || digits(leaf.substr(6), 1).has_value();
}
bool is_bias(std::string_view leaf) {
  if (!leaf.starts_with("bias")) return false;
  return leaf.size() == 4 || digits(leaf.substr(4), 1).has_value();
}

}  // namespace

std::optional<RankDir> parse_rank_dir(std::string_view name) {
  if (!name.starts_with("mp_rank_")) return std::nullopt;
  std::string_view rest = name.substr(8);
  RankDir r;
  for (size_t part = 0;; ++part) {
    const size_t us = rest.find('_');
    const auto v = digits(rest.substr(0, us), part == 0 ? 2 : 3);
    if (!v || part > 2) return std::nullopt;
    (part == 0 ? r.tp : r.more.emplace_back()) = *v;
    if (us == std::string_view::npos) return r;
    rest = rest.substr(us + 1);
  }
}

bool is_iteration_dir(std::string_view name) {
  return name == "release" || (name.starts_with("iter_") && digits(name.substr(5), 7).has_value());
}

std::optional<std::string> iteration_dir_of_tracker(std::string_view text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r' || text.back() == ' ')) text.remove_suffix(1);
  while (!text.empty() && text.front() == ' ') text.remove_prefix(1);
  if (text == "release") return std::string("release");
  const auto n = digits(text, 1);
  if (!n) return std::nullopt;
  std::string s = std::to_string(*n);
  if (s.size() < 7) s.insert(0, 7 - s.size(), '0');
  return "iter_" + s;
}

std::optional<int> tensor_parallel_dim(std::string_view name) {
  const auto [module, leaf] = last_two(name);
  const bool column = module == "linear_qkv" || module == "linear_fc1" || module == "query_key_value" ||
                      module == "dense_h_to_4h" || module == "word_embeddings" || module == "output_layer" ||
                      module == "linear_q_proj" || module == "linear_q_up_proj" || module == "linear_kv_up_proj";
  const bool row = module == "linear_proj" || module == "linear_fc2" || module == "dense" || module == "dense_4h_to_h";
  if (column && (is_weight(leaf) || is_bias(leaf))) return 0;
  if (row && is_weight(leaf)) return 1;
  return std::nullopt;
}

std::optional<std::string> second_projection_of(std::string_view name) {
  const auto [module, leaf] = last_two(name);
  if ((module != "linear_fc1" && module != "dense_h_to_4h") || !(is_weight(leaf) || is_bias(leaf))) return std::nullopt;
  const std::string_view above = name.substr(0, name.size() - leaf.size() - 1 - module.size());
  const std::string_view k = leaf.substr(leaf.starts_with("weight") ? 6 : 4);
  return fmt::format("{}{}.weight{}", above, module == "linear_fc1" ? "linear_fc2" : "dense_4h_to_h", k);
}

std::optional<Split> shard_runs(const std::vector<int64_t>& local_shape, int dim, bool glu, int64_t tp, int64_t tp_size) {
  if (dim < 0 || static_cast<size_t>(dim) >= local_shape.size() || tp < 0 || tp >= tp_size || tp_size < 1) return std::nullopt;
  if (glu && (dim != 0 || local_shape[0] % 2 != 0)) return std::nullopt;
  for (int64_t s : local_shape)
    if (s < 0 || s > (int64_t{1} << 40) / tp_size) return std::nullopt;
  Split out;
  out.whole = local_shape;
  out.whole[static_cast<size_t>(dim)] *= tp_size;
  // Elements per index of `dim` and below it (an "inner" block), and the blocks above it.
  int64_t inner = 1, outer = 1;
  for (size_t d = static_cast<size_t>(dim) + 1; d < local_shape.size(); ++d) inner *= local_shape[d];
  for (size_t d = 0; d < static_cast<size_t>(dim); ++d) outer *= local_shape[d];
  const int64_t local_dim = local_shape[static_cast<size_t>(dim)];
  const int64_t whole_dim = local_dim * tp_size;
  if (inner == 0 || local_dim == 0 || outer == 0) return out;
  if (glu) {  // two halves: the rank's rows of the gate, then of the up projection
    const int64_t half = local_dim / 2;
    for (int64_t h = 0; h < 2; ++h)
      out.runs.push_back({h * half * inner, (h * half * tp_size + tp * half) * inner, half * inner});
    return out;
  }
  for (int64_t o = 0; o < outer; ++o)
    out.runs.push_back({o * local_dim * inner, (o * whole_dim + tp * local_dim) * inner, local_dim * inner});
  return out;
}

namespace {

// Where a name's layer index lies: [begin, end) of its digits, the stack before them.
std::optional<std::pair<size_t, size_t>> layer_digits(std::string_view name) {
  for (size_t at = 0; (at = name.find("layers.", at)) != std::string_view::npos; at += 7) {
    if (at != 0 && name[at - 1] != '.') continue;
    const size_t begin = at + 7;
    size_t end = begin;
    while (end < name.size() && name[end] >= '0' && name[end] <= '9') ++end;
    if (end > begin && end - begin <= 9 && end < name.size() && name[end] == '.') return std::pair{begin, end};
  }
  return std::nullopt;
}

}  // namespace

std::optional<LayerOf> layer_of(std::string_view name) {
  const auto d = layer_digits(name);
  if (!d) return std::nullopt;
  return LayerOf{std::string(name.substr(0, d->first)), *digits(name.substr(d->first, d->second - d->first), 1)};
}

std::string renumber_layer(std::string_view name, int64_t offset) {
  const auto d = layer_digits(name);
  if (!d || offset == 0) return std::string(name);
  const int64_t i = *digits(name.substr(d->first, d->second - d->first), 1);
  return fmt::format("{}{}{}", name.substr(0, d->first), i + offset, name.substr(d->second));
}

namespace {

constexpr std::string_view kExperts = ".mlp.experts.";
constexpr std::string_view kLocalExperts = "local_experts.";

// Where a name's local expert index lies: [begin, end) of its digits.
std::optional<std::pair<size_t, size_t>> expert_digits(std::string_view name) {
  const size_t at = name.find(kExperts);
  if (at == std::string_view::npos) return std::nullopt;
  const size_t after = at + kExperts.size();
  std::string_view rest = name.substr(after);
  if (rest.starts_with(kLocalExperts)) {  // SequentialMLP: local_experts.<i>.<module>.<leaf>
    const size_t begin = after + kLocalExperts.size();
    size_t end = begin;
    while (end < name.size() && name[end] >= '0' && name[end] <= '9') ++end;
    if (end > begin && end - begin <= 9 && end < name.size() && name[end] == '.') return std::pair{begin, end};
    return std::nullopt;
  }
  // TEGroupedMLP: <linear_fc1|linear_fc2>.<weight|bias><i>, the name's end
  const auto [module, leaf] = last_two(name);
  if ((module != "linear_fc1" && module != "linear_fc2") || rest != fmt::format("{}.{}", module, leaf)) return std::nullopt;
  const size_t k = leaf.starts_with("weight") ? 6 : leaf.starts_with("bias") ? 4 : leaf.size();
  if (k >= leaf.size() || !digits(leaf.substr(k), 1)) return std::nullopt;
  return std::pair{name.size() - (leaf.size() - k), name.size()};
}

}  // namespace

bool is_expert_param(std::string_view name) { return name.find(kExperts) != std::string_view::npos; }

std::optional<int64_t> expert_of(std::string_view name) {
  const auto d = expert_digits(name);
  if (!d) return std::nullopt;
  return digits(name.substr(d->first, d->second - d->first), 1);
}

std::string renumber_expert(std::string_view name, int64_t offset) {
  const auto d = expert_digits(name);
  if (!d || offset == 0) return std::string(name);
  const int64_t i = *digits(name.substr(d->first, d->second - d->first), 1);
  return fmt::format("{}{}{}", name.substr(0, d->first), i + offset, name.substr(d->second));
}

std::optional<ChunkOf> chunk_of(std::string_view name) {
  if (!name.starts_with("model")) return std::nullopt;
  const size_t dot = name.find('.');
  if (dot == std::string_view::npos || dot == 5) return std::nullopt;
  const auto c = digits(name.substr(5, dot - 5), 1);
  if (!c) return std::nullopt;
  return ChunkOf{*c, name.substr(dot + 1)};
}

std::string global_name(std::string_view local, const std::map<std::string, int64_t>* layer_offsets,
                        int64_t expert_offset, bool chunked) {
  std::string name(local);
  if (layer_offsets)
    if (const auto l = layer_of(name))
      if (const auto o = layer_offsets->find(l->stack); o != layer_offsets->end()) name = renumber_layer(name, o->second);
  if (expert_offset) name = renumber_expert(name, expert_offset);
  if (chunked)
    if (const auto c = chunk_of(name)) name = std::string(c->rest);
  return name;
}

namespace {

constexpr int64_t kParamAlignment = 64;  // Megatron's _pad_start_of_param_if_needed
constexpr int64_t kDenseSample = 4096;   // places compared where two starts both fit the first sample

std::vector<int64_t> dense_places(int64_t numel) {
  std::vector<int64_t> at;
  const int64_t n = std::min(numel, kDenseSample);
  for (int64_t i = 0; i < n; ++i) at.push_back(numel <= kDenseSample ? i : i * (numel - 1) / (n - 1));
  return at;
}

}  // namespace

Result<std::vector<std::optional<int64_t>>> place_in_buffer(int64_t numel_unpadded, const std::vector<int64_t>& numels,
                                                            const std::vector<std::string>& names,
                                                            const BufferValues& values, const std::string& where) {
  std::vector<std::optional<int64_t>> out(numels.size());
  auto fits = [&](size_t t, int64_t start, const std::vector<int64_t>& places) -> Result<bool> {
    if (start > numel_unpadded || numels[t] > numel_unpadded - start) return false;
    std::vector<int64_t> at(places.size());
    for (size_t i = 0; i < places.size(); ++i) at[i] = start + places[i];
    OPTSTATE_ASSIGN_OR_RETURN(const auto b, values.buffer(at));
    OPTSTATE_ASSIGN_OR_RETURN(const auto w, values.tensor(t, places));
    if (b.size() != places.size() || w.size() != places.size()) return internal_error(where + ": a sample of another size");
    return b == w;
  };
  int64_t pos = 0, bucket = 0;  // where the last param ended; where its bucket began
  std::optional<size_t> first_unplaced;  // since the last param placed
  for (size_t k = numels.size(); k-- > 0;) {  // reverse module order
    if (numels[k] < 0) return internal_error(where + ": a negative size");
    if (numels[k] == 0) continue;
    const int64_t into = pos - bucket;
    const int64_t aligned = bucket + (into + kParamAlignment - 1) / kParamAlignment * kParamAlignment;
    const auto sample = dcp::megatron::sample_places(numels[k]);
    OPTSTATE_ASSIGN_OR_RETURN(bool at_aligned, fits(k, aligned, sample));
    bool at_new = false;
    if (aligned != pos) {
      OPTSTATE_ASSIGN_OR_RETURN(at_new, fits(k, pos, sample));
    }
    if (at_aligned && at_new) {
      const auto dense = dense_places(numels[k]);
      OPTSTATE_ASSIGN_OR_RETURN(at_aligned, fits(k, aligned, dense));
      OPTSTATE_ASSIGN_OR_RETURN(at_new, fits(k, pos, dense));
      if (at_aligned && at_new)
        return unsupported(fmt::format("{}: '{}' fits the buffer both at element {} and at {} (its weights and the "
                                       "padding alike: all zeros?), so where Megatron put it is not known",
                                       where, names[k], pos, aligned));
    }
    if (!at_aligned && !at_new) {
      if (!first_unplaced) first_unplaced = k;
      continue;
    }
    const int64_t start = at_aligned ? aligned : pos;
    if (!at_aligned) bucket = pos;
    out[k] = start;
    pos = start + numels[k];
    first_unplaced.reset();
  }
  if (pos != numel_unpadded)
    return corrupt(fmt::format("{}: its params fill {} of the buffer's {} elements; {}", where, pos, numel_unpadded,
                               first_unplaced ? fmt::format("the main params after element {} do not round to the "
                                                            "weights of '{}' (nor of any param after it) where Megatron "
                                                            "lays it out", pos, names[*first_unplaced])
                                              : std::string("the rest is no param's")));
  return out;
}

}  // namespace optstate::megatron
