#include "megatron.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "optstate/json_strict.h"

namespace optstate::dcp::megatron {

using pickle::Kind;
using pickle::kNoRef;
using pickle::Pickle;
using pickle::Ref;
using pickle::Refs;
using pickle::Value;

std::string sharded_backend(std::string_view metadata_json) {
  std::optional<std::string> twice;
  std::string refused;
  const auto j = parse_json_strict(metadata_json.data(), metadata_json.data() + metadata_json.size(), twice, refused);
  if (!j.is_object() || twice) return "";  // a backend named twice could be read either way
  const auto backend = j.find("sharded_backend");
  return backend != j.end() && backend->is_string() ? backend->get<std::string>() : "";
}

Result<std::vector<FileDigest>> parse_integrity_manifest(std::string_view text, const std::string& where) {
  std::optional<std::string> twice;
  std::string refused;
  const auto j = parse_json_strict(text.data(), text.data() + text.size(), twice, refused);
  if (j.is_discarded() || !j.is_object())
    return corrupt(fmt::format("{}: not a JSON object{}", where, refused.empty() ? "" : " (" + refused + ")"));
  if (twice) return corrupt(fmt::format("{}: key '{}' twice", where, *twice));
  if (const auto a = j.find("algorithm"); a != j.end() && !(a->is_string() && a->get<std::string>() == "sha256"))
    return unsupported(fmt::format("{}: digests by '{}', not sha256 (Megatron-Core's)", where,
                                   a->is_string() ? a->get<std::string>() : a->dump()));
  const auto files = j.find("files");
  if (files == j.end() || !files->is_object()) return corrupt(where + ": no 'files' object");
  if (files->size() > kMaxIntegrityFiles)
    return corrupt(fmt::format("{}: {} files listed (at most {})", where, files->size(), kMaxIntegrityFiles));
  std::vector<FileDigest> out;
  for (const auto& [name, digest] : files->items()) {
    if (name.empty() || name == "." || name == ".." || name == kIntegrityManifest || name.size() > 255 ||
        name.find_first_of(std::string_view("/\\\0", 3)) != std::string::npos)
      return corrupt(fmt::format("{}: '{}' is not a file name of the checkpoint folder", where, printable(name)));
    const std::string* hex = digest.get_ptr<const std::string*>();
    if (!hex || hex->size() != 64 || hex->find_first_not_of("0123456789abcdef") != std::string::npos)
      return corrupt(fmt::format("{}: file '{}': its digest is not 64 lowercase hex digits", where, name));
    out.push_back({name, *hex});
  }
  return out;
}

namespace {

const Refs* list_of(const Pickle& p, Ref r) {
  if (r == kNoRef) return nullptr;
  const auto& v = p.at(r);
  return v.kind == Kind::kList || v.kind == Kind::kTuple ? &v.items : nullptr;
}

Result<double> number_field(const Pickle& p, Ref group, const char* key, const std::string& gw,
                            std::optional<double> fallback) {
  const Ref r = p.dict_get(group, key);
  if (r == kNoRef) {
    if (fallback) return *fallback;
    return corrupt(fmt::format("{}: no '{}'", gw, key));
  }
  if (const auto b = as_bool(p, r)) return *b ? 1.0 : 0.0;
  const auto v = as_number(p, r);
  if (!v) return corrupt(fmt::format("{}: '{}' is not a number", gw, key));
  return *v;
}

// Keys a group's extras leave out: what is read into the state, and Megatron's step.
bool read_key(std::string_view key) { return known_group_key(key) || key == "step"; }

Result<Group> interpret_group(const Pickle& p, Ref g, const std::string& gw) {
  if (g == kNoRef || p.at(g).kind != Kind::kDict) return corrupt(gw + ": not a dict");
  auto has = [&](const char* key) { return p.dict_get(g, key) != kNoRef; };
  OPTSTATE_RETURN_IF_ERROR(check_torch_adam_group(has, gw));
  Group out;
  Hyperparameters& h = out.hyper;
  OPTSTATE_ASSIGN_OR_RETURN(h.lr, number_field(p, g, "lr", gw, std::nullopt));
  OPTSTATE_ASSIGN_OR_RETURN(h.eps, number_field(p, g, "eps", gw, std::nullopt));
  OPTSTATE_ASSIGN_OR_RETURN(h.weight_decay, number_field(p, g, "weight_decay", gw, std::nullopt));
  OPTSTATE_ASSIGN_OR_RETURN(const double ams, number_field(p, g, "amsgrad", gw, 0.0));
  OPTSTATE_ASSIGN_OR_RETURN(const double maxi, number_field(p, g, "maximize", gw, 0.0));
  h.amsgrad = ams != 0;
  h.maximize = maxi != 0;
  const auto* betas = list_of(p, p.dict_get(g, "betas"));
  if (!betas || betas->size() != 2) return corrupt(gw + ": 'betas' is not a pair of numbers (not an AdamW param group)");
  const auto b1 = as_number(p, (*betas)[0]), b2 = as_number(p, (*betas)[1]);
  if (!b1 || !b2) return corrupt(gw + ": 'betas' is not a pair of numbers (not an AdamW param group)");
  h.beta1 = *b1;
  h.beta2 = *b2;
  // Megatron's Adam with --no-decoupled-weight-decay (torch.optim.Adam, or TE's/apex's FusedAdam
  // out of AdamW mode): L2 decay in the gradient, another update than AdamW's where it decays.
  for (const char* key : {"decoupled_weight_decay", "adam_w_mode"})
    if (const auto d = as_bool(p, p.dict_get(g, key)); d && !*d && h.weight_decay != 0)
      return corrupt(fmt::format("{}: {}=False with weight_decay {}: Adam's L2 decay, not AdamW's decoupled decay",
                                 gw, key, h.weight_decay));
  if (const auto bc = as_bool(p, p.dict_get(g, "bias_correction")); bc && !*bc)
    return corrupt(gw + ": bias_correction=False: not AdamW's update");
  for (const auto& [name, fallback] : kAdamWFlagDefaults)
    if (const auto v = as_flag(p, p.dict_get(g, name))) out.flags.emplace(name, *v);
  OPTSTATE_ASSIGN_OR_RETURN(out.wd_mult, number_field(p, g, "wd_mult", gw, 1.0));
  OPTSTATE_ASSIGN_OR_RETURN(const double ep, number_field(p, g, "is_expert_parallel", gw, 0.0));
  out.expert_parallel = ep != 0;
  const auto& items = p.at(g).items;
  for (size_t i = 0; i + 1 < items.size(); i += 2) {
    const auto key = as_string(p, items[i]);
    if (!key || read_key(*key)) continue;
    if (auto v = as_group_value(p, items[i + 1])) out.extras.emplace_back(*key, std::move(*v));
  }
  return out;
}

}  // namespace

namespace {

// One optimizer's state dict as Megatron's sharded_state_dict leaves it in common.pt.
Result<Optimizer> interpret_optimizer(const Pickle& p, Ref opt, const std::string& where,
                                      std::string_view file = "common.pt") {
  if (p.at(opt).kind != Kind::kDict) return corrupt(fmt::format("{}: {}'s 'optimizer' is not a dict", where, file));
  Optimizer out;
  if (const Ref st = p.dict_get(opt, "param_state_sharding_type"); st != kNoRef) {
    const auto sharding = as_string(p, st);
    if (!sharding) return corrupt(where + ": param_state_sharding_type is not a string");
    out.sharding = *sharding;
    // Per-key items: fully_reshardable's whole tensors, fully_sharded_model_space's N-D flattened
    // ranges (ItemMeta::nd_shape). dp_reshardable: flat buffers of the DDP buckets, the param
    // groups in each data-parallel group's own item (megatron_buckets.h), read by the caller.
    // dp_zero_gather_scatter: each data-parallel group's buffers gathered flat into one object,
    // its param groups in another, as dp_reshardable's (read by the caller too).
    if (*sharding == "dp_reshardable" || *sharding == "dp_zero_gather_scatter") return out;
    if (*sharding != "fully_reshardable" && *sharding != "fully_sharded_model_space")
      return unsupported(fmt::format("{}: Megatron's distributed optimizer saved '{}' (fsdp_dtensor: "
                                     "Megatron-FSDP's; fully_sharded_bucket_space: Megatron-Core 0.7's, "
                                     "deprecated), which optstate does not read; it reads it saved "
                                     "'dp_reshardable' (the default since Megatron-Core 0.14), 'fully_reshardable' "
                                     "(Megatron-LM's --dist-ckpt-optim-fully-reshardable), "
                                     "'fully_sharded_model_space' (Megatron-Core up to 0.13) or "
                                     "'dp_zero_gather_scatter'",
                                     where, *sharding));
    opt = p.dict_get(opt, "optimizer");
    if (opt == kNoRef || p.at(opt).kind != Kind::kDict)
      return corrupt(fmt::format("{}: the distributed optimizer's {} has no 'optimizer' dict", where, file));
  }
  // Megatron's mixed-precision optimizer (bf16/fp16 params: Float16OptimizerWithFloat16Params) saves
  // its torch optimizer's state dict one level down, beside its own keys (a grad scaler's).
  if (p.dict_get(opt, "param_groups") == kNoRef && out.sharding.empty()) {
    const Ref inner = p.dict_get(opt, "optimizer");
    if (inner != kNoRef && p.at(inner).kind == Kind::kDict) opt = inner;
  }
  const auto* groups = list_of(p, p.dict_get(opt, "param_groups"));
  if (!groups) return corrupt(fmt::format("{}: {} has no optimizer param_groups list", where, file));
  if (groups->empty()) return corrupt(fmt::format("{}: {}'s optimizer has no param groups", where, file));
  for (size_t g = 0; g < groups->size(); ++g) {
    const std::string gw = fmt::format("{}: {} param group {}", where, file, g);
    OPTSTATE_ASSIGN_OR_RETURN(Group group, interpret_group(p, (*groups)[g], gw));
    if (const Ref s = p.dict_get((*groups)[g], "step"); s != kNoRef) {
      const auto step = as_number(p, s);
      if (!step || !(*step >= 0 && *step < 9.2e18)) return corrupt(gw + ": 'step' is not a count");
      if (out.group_step && *out.group_step != *step)
        return corrupt(fmt::format("{}: step {} where group 0 has {}", gw, *step, *out.group_step));
      out.group_step = *step;
    }
    out.groups.push_back(std::move(group));
  }
  if (const Ref state = p.dict_get(opt, "state"); state != kNoRef && p.at(state).kind == Kind::kDict)
    out.step_ref = p.dict_get(state, "common_step");
  return out;
}

}  // namespace

Result<Optimizer> interpret_legacy_optimizer(const Pickle& p, Ref opt, const std::string& where) {
  if (opt == kNoRef) return corrupt(where + ": no 'optimizer' (saved with --no-save-optim)");
  return interpret_optimizer(p, opt, where, "model_optim_rng.pt");
}

Result<std::vector<FlatBuffer>> interpret_param_state(const Pickle& p, Ref root, const std::string& where) {
  // saved as a ShardedObject: its one-element list (torch_dist)
  if (const auto* listed = list_of(p, root); listed && listed->size() == 1) root = (*listed)[0];
  if (root == kNoRef || p.at(root).kind != Kind::kDict) return corrupt(where + ": not a dict of buffers");
  const Ref coalesced = p.dict_get(root, "buckets_coalesced");
  if (coalesced == kNoRef || p.at(coalesced).kind != Kind::kBool || !p.at(coalesced).i)
    return unsupported(where + ": not 'buckets_coalesced' (a Megatron-Core before 0.7 saved each bucket apart); "
                               "optstate reads the state as Megatron-Core 0.7 and later save it");
  std::vector<FlatBuffer> out;
  const auto& items = p.at(root).items;
  for (size_t k = 0; k + 1 < items.size(); k += 2) {
    if (p.at(items[k]).kind != Kind::kInt) {
      if (as_string(p, items[k]) == std::optional<std::string>("buckets_coalesced")) continue;
      return corrupt(where + ": a key that is neither a buffer's number nor 'buckets_coalesced'");
    }
    FlatBuffer fb;
    fb.gbuf = p.at(items[k]).i;
    const std::string bw = fmt::format("{} [{}]", where, fb.gbuf);
    if (!out.empty() && fb.gbuf <= out.back().gbuf) return corrupt(bw + ": buffers out of order");
    const auto* by_dtype = p.at(items[k + 1]).kind == Kind::kDict ? &p.at(items[k + 1]).items : nullptr;
    if (!by_dtype || by_dtype->size() != 2) return corrupt(bw + ": not one dtype's state (Megatron's buffer holds one)");
    const auto* dtypes = p.at((*by_dtype)[0]).kind == Kind::kTuple ? &p.at((*by_dtype)[0]).items : nullptr;
    if (!dtypes || dtypes->size() != 2 || p.at((*dtypes)[0]).kind != Kind::kGlobal ||
        static_cast<std::string_view>(p.at((*dtypes)[0]).s) != "torch")
      return corrupt(bw + ": its key is not (param dtype, grad dtype)");
    const std::string_view dname = p.at((*dtypes)[0]).name();
    if (dname != "bfloat16" && dname != "float16" && dname != "float32")
      return unsupported(fmt::format("{}: params of torch.{}; optstate reads bf16, fp16 and fp32 params", bw, dname));
    fb.param_dtype = dname == "bfloat16" ? DType::kBF16 : dname == "float16" ? DType::kF16 : DType::kF32;
    const Ref st = (*by_dtype)[1];
    const Ref n = p.dict_get(st, "numel_unpadded");
    if (n == kNoRef || p.at(n).kind != Kind::kInt || p.at(n).i <= 0) return corrupt(bw + ": no 'numel_unpadded' count");
    fb.numel = p.at(n).i;
    for (const char* e : {"param", "exp_avg", "exp_avg_sq"}) {
      const std::string ew = fmt::format("{} '{}'", bw, e);
      const Ref r = p.dict_get(st, e);
      if (r == kNoRef) return corrupt(ew + ": missing");
      OPTSTATE_ASSIGN_OR_RETURN(const Payload v, interpret_value(p, r, ew));
      if (v.kind != Payload::Kind::kTensor || v.tensor.dtype != DType::kF32 ||
          v.tensor.shape != std::vector<int64_t>{fb.numel} || v.tensor.permuted() || v.tensor.offset < 0 ||
          v.tensor.offset > v.tensor.storage_numel - fb.numel)
        return corrupt(fmt::format("{}: not a float32 tensor of its numel_unpadded {} elements", ew, fb.numel));
      fb.entries.emplace(e, v.tensor);
    }
    out.push_back(std::move(fb));
  }
  if (out.empty()) return corrupt(where + ": no buffer");
  return out;
}

Result<Optimizer> interpret_group_optimizer(const Pickle& p, const std::string& where) {
  Ref root = p.root();
  // saved as a ShardedObject: its one-element list
  if (const auto* listed = list_of(p, root); listed && listed->size() == 1) root = (*listed)[0];
  if (root == kNoRef || p.at(root).kind != Kind::kDict || p.dict_get(root, "param_groups") == kNoRef)
    return corrupt(where + ": not the distributed optimizer's state dict (no param_groups)");
  OPTSTATE_ASSIGN_OR_RETURN(Optimizer out, interpret_optimizer(p, root, where));
  out.sharding = "dp_reshardable";
  return out;
}

Result<Common> interpret_common(const Pickle& p, const std::string& where, Ref root, std::string_view file) {
  if (root == kNoRef) root = p.root();
  if (root == kNoRef || p.at(root).kind != Kind::kDict) return corrupt(where + ": the common state is not a dict");
  Common out;
  const auto& items = p.at(root).items;
  Ref opt = p.dict_get(root, "optimizer");
  // NeMo 1.x (its NLPDDPStrategy) saves Lightning's checkpoint dict: the optimizers' sharded state
  // dicts as `optimizer_states`, a list, the model's as `sharded_state_dict`.
  const char* opt_key = "optimizer";
  if (opt == kNoRef && (opt = p.dict_get(root, "optimizer_states")) != kNoRef) {
    opt_key = "optimizer_states";
    out.lightning = true;
    if (!list_of(p, opt)) return corrupt(fmt::format("{}: {}'s 'optimizer_states' (NeMo's) is not a list", where, file));
  }
  for (size_t i = 0; i + 1 < items.size(); i += 2)
    if (const auto key = as_string(p, items[i]); key && *key != opt_key) out.other_keys.push_back(*key);
  if (const Ref cm = p.dict_get(root, "content_metadata"); cm != kNoRef)
    out.avoid_prefix = as_bool(p, p.dict_get(cm, "chained_optim_avoid_prefix")).value_or(false);
  if (opt == kNoRef)
    return corrupt(fmt::format("{}: a Megatron checkpoint without optimizer state ({} has no 'optimizer', nor NeMo's "
                               "'optimizer_states': saved with --no-save-optim, or weights only)",
                               where, file));
  // NeMo (1.x's NLPDDPStrategy, 2's MegatronStrategy) saves Lightning's optimizers as a list:
  // [sharded_state_dict].
  if (const auto* listed = list_of(p, opt)) {
    if (listed->size() != 1)
      return unsupported(fmt::format("{}: a list of {} optimizers in {} (NeMo's Lightning optimizers); "
                                     "optstate reads one",
                                     where, listed->size(), file));
    opt = (*listed)[0];
  }
  const auto& ov = p.at(opt);
  // A chain (ChainedOptimizer of several): {0: sd, 1: sd, ...}, the keys the optimizers' places.
  const bool chain = ov.kind == Kind::kDict && !ov.items.empty() && p.at(ov.items[0]).kind == Kind::kInt;
  if (!chain) {
    OPTSTATE_ASSIGN_OR_RETURN(Optimizer one, interpret_optimizer(p, opt, where, file));
    out.optimizers.push_back(std::move(one));
    return out;
  }
  out.chained = true;
  const size_t n = ov.items.size() / 2;
  if (n > 64) return corrupt(fmt::format("{}: a chain of {} optimizers", where, n));
  for (size_t i = 0; i < n; ++i) {
    const Value& k = p.at(ov.items[2 * i]);
    if (k.kind != Kind::kInt || k.i != static_cast<int64_t>(i))
      return corrupt(fmt::format("{}: the chain of optimizers' key {} is not {}", where, 2 * i, i));
    OPTSTATE_ASSIGN_OR_RETURN(Optimizer one,
                              interpret_optimizer(p, ov.items[2 * i + 1], fmt::format("{} (optimizer {})", where, i), file));
    out.optimizers.push_back(std::move(one));
  }
  return out;
}

std::optional<StateItem> state_item(std::string_view item_key) {
  StateItem out;
  if (item_key.starts_with("chained_")) {
    const std::string_view rest = item_key.substr(8);
    const auto dot = rest.find('.');
    if (dot == std::string_view::npos || dot == 0 || dot > 2 ||
        rest.substr(0, dot).find_first_not_of("0123456789") != std::string_view::npos)
      return std::nullopt;
    out.chain = std::stoi(std::string(rest.substr(0, dot)));
    item_key = rest.substr(dot + 1);
  }
  constexpr std::string_view kPrefix = "optimizer.state.";
  if (!item_key.starts_with(kPrefix)) return std::nullopt;
  const std::string_view rest = item_key.substr(kPrefix.size());
  const auto dot = rest.find('.');
  if (dot == std::string_view::npos || dot == 0 || dot + 1 == rest.size()) return std::nullopt;
  out.entry = std::string(rest.substr(0, dot));
  out.key = std::string(rest.substr(dot + 1));
  return out;
}

std::optional<size_t> unprefixed_chain(const Common& c, std::string_view key) {
  if (!c.chained || c.optimizers.size() != 2) return std::nullopt;
  auto experts = [](const Optimizer& o) {
    return std::all_of(o.groups.begin(), o.groups.end(), [](const Group& g) { return g.expert_parallel; });
  };
  auto dense = [](const Optimizer& o) {
    return std::none_of(o.groups.begin(), o.groups.end(), [](const Group& g) { return g.expert_parallel; });
  };
  size_t expert_opt = 0;
  if (experts(c.optimizers[1]) && dense(c.optimizers[0]))
    expert_opt = 1;
  else if (!(experts(c.optimizers[0]) && dense(c.optimizers[1])))
    return std::nullopt;
  const bool expert_key = key.find(".experts.") != std::string_view::npos;
  return expert_key ? expert_opt : 1 - expert_opt;
}

size_t stacked_axes(const ItemMeta& im) {
  size_t n = 0;
  if (!im.nd_shape.empty()) {  // N-D flattened: where a chunk box is one wide
    while (n + 1 < im.nd_shape.size() && im.size[n] == im.nd_shape[n]) ++n;
    return n;
  }
  while (n + 1 < im.size.size() && !im.chunks.empty() &&
         std::all_of(im.chunks.begin(), im.chunks.end(),
                     [&](const ChunkMeta& c) { return c.sizes.size() == im.size.size() && c.sizes[n] == 1; }))
    ++n;
  return n;
}

bool standard_no_decay(std::string_view key, const ItemMeta& im) {
  return key.ends_with(".bias") || tensor_shape(im).size() - stacked_axes(im) == 1;
}

}  // namespace optstate::dcp::megatron
