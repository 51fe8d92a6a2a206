#include "torchsave_layout.h"

#include <fmt/format.h>

#include <cctype>
#include <cmath>
#include <algorithm>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <tuple>
#include <unordered_map>

#include "dcp/bnb_state.h"
#include "megatron/megatron_layout.h"
#include "optstate/quant8.h"

namespace optstate::torchsave {
namespace {

using dcp::Payload;
using dcp::TensorRef;
using pickle::Kind;
using pickle::kNoRef;
using pickle::Pickle;
using pickle::Ref;
using pickle::Refs;

}  // namespace

const Refs* dict_items(const Pickle& p, Ref r) {
  if (r == kNoRef) return nullptr;
  const auto& v = p.at(r);
  if (v.kind == Kind::kDict) return &v.items;
  if (v.kind == Kind::kObject && p.is_global(v.callable, "collections", "OrderedDict")) return &v.items;
  return nullptr;
}

namespace {

bool is_optimizer_dict(const Pickle& p, Ref r) {
  return dict_items(p, r) && p.dict_get(r, "state") != kNoRef && p.dict_get(r, "param_groups") != kNoRef;
}

// An optimizer per param, keyed by its fqn: what optimizer-in-backward loops save (torchtune's
// OptimizerInBackwardWrapper.state_dict(): {fqn: optimizer.state_dict()}, each optimizer built over
// [param]): a dict of at least `least` entries, every value an optimizer's state_dict of one group
// listing one param.
bool is_per_param_dict(const Pickle& p, Ref r, size_t least) {
  const auto* items = dict_items(p, r);
  if (!items || items->size() / 2 < least) return false;
  for (size_t k = 0; k + 1 < items->size(); k += 2) {
    const Ref v = (*items)[k + 1];
    if (!dcp::as_string(p, (*items)[k]) || !is_optimizer_dict(p, v)) return false;
    const auto* groups = list_items(p, p.dict_get(v, "param_groups"));
    if (!groups || groups->size() != 1) return false;
    const auto* ids = list_items(p, p.dict_get((*groups)[0], "params"));
    if (!ids || ids->size() != 1) return false;
  }
  return true;
}

}  // namespace

const Refs* list_items(const Pickle& p, Ref r) {
  if (r == kNoRef) return nullptr;
  const auto& v = p.at(r);
  return v.kind == Kind::kList || v.kind == Kind::kTuple ? &v.items : nullptr;
}

namespace {

// A number, or a one-element tensor the driver will read.
Result<Scalar> scalar(const Pickle& p, Ref r, const std::string& where) {
  Scalar s;
  if (auto n = dcp::as_number(p, r)) {
    s.number = *n;
    return s;
  }
  auto v = dcp::interpret_value(p, r, where);
  if (!v.ok()) return v.status();
  if (v->kind != Payload::Kind::kTensor || *checked_numel(v->tensor.shape) != 1)
    return corrupt(where + ": neither a number nor a one-element tensor");
  s.tensor = v->tensor;
  return s;
}

Result<double> number(const Pickle& p, Ref group, const char* key, const std::string& where) {
  const Ref r = p.dict_get(group, key);
  if (r == kNoRef) return corrupt(fmt::format("{}: no '{}' (not an AdamW param group)", where, key));
  auto n = dcp::as_number(p, r);
  if (!n) return corrupt(fmt::format("{}: '{}' is not a number", where, key));
  return *n;
}

Result<bool> flag(const Pickle& p, Ref group, const char* key, const std::string& where) {
  const Ref r = p.dict_get(group, key);
  if (r == kNoRef || p.at(r).kind == Kind::kNone) return false;
  auto b = dcp::as_bool(p, r);
  if (!b) return corrupt(fmt::format("{}: '{}' is not a bool", where, key));
  return *b;
}


bool is_moment(const std::string& name) { return name == kExpAvg || name == kExpAvgSq || name == kMaxExpAvgSq; }

// Group flags that, False, mean Adam's L2 decay rather than AdamW's decoupled decay.
constexpr const char* kCoupledDecayFlags[] = {"decoupled_weight_decay", "is_adamw", "adam_w_mode", "adamw_mode"};

struct GroupInfo {
  int64_t block = 0;  // optstate's AdamW8bit: its block_size and map names
  std::string signed_map = std::string(qmap_name(QMap::kDynamicSigned));
  std::string unsigned_map = std::string(qmap_name(QMap::kDynamicUnsigned));
};

// Sets `shape` from the first entry; every later one must agree.
Status same_shape(std::optional<std::vector<int64_t>>& shape, const std::vector<int64_t>& s, const std::string& where) {
  if (!shape) {
    shape = s;
    return Status::Ok();
  }
  if (*shape != s)
    return corrupt(fmt::format("{}: shape {}, the param's other state has {}", where, format_shape(s), format_shape(*shape)));
  return Status::Ok();
}

bool is_dtensor_class(const Pickle& p, Ref cls) {
  if (cls == kNoRef || p.at(cls).kind != Kind::kGlobal) return false;
  const auto& v = p.at(cls);
  return v.name() == "DTensor" && v.s.starts_with("torch.distributed.");  // .tensor, ._tensor.api, .tensor._api
}

// A placement object: Shard(dim) or Replicate(); anything else is refused by name.
Result<Placement> placement(const Pickle& p, Ref r, size_t ndim, const std::string& where) {
  const auto& v = p.at(r);
  if (v.kind != Kind::kObject || v.callable == kNoRef || p.at(v.callable).kind != Kind::kGlobal ||
      !p.at(v.callable).s.ends_with("placement_types"))
    return corrupt(where + ": a placement that is not one of torch.distributed.tensor's");
  const std::string_view cls = p.at(v.callable).name();
  Placement out;
  if (cls == "Replicate") return out;
  if (cls != "Shard")
    return corrupt(fmt::format("{}: a {} placement ({}); optstate reads Shard and Replicate", where, cls,
                               cls == "_StridedShard" ? "FSDP2 and tensor parallelism on one dim"
                               : cls == "Partial"     ? "a pending reduction, no values yet"
                                                      : "unknown"));
  Ref dim = p.dict_get(dcp::fields_of(p, r), "dim");
  if (dim == kNoRef && v.args != kNoRef && p.at(v.args).items.size() == 1) dim = p.at(v.args).items[0];
  if (dim == kNoRef || p.at(dim).kind != Kind::kInt) return corrupt(where + ": a Shard placement without its dim");
  int64_t d = p.at(dim).i;
  if (d < 0) d += static_cast<int64_t>(ndim);
  if (d < 0 || d >= static_cast<int64_t>(ndim))
    return corrupt(fmt::format("{}: Shard({}) of a {}-d tensor", where, p.at(dim).i, ndim));
  out.kind = Placement::Kind::kShard;
  out.dim = static_cast<int>(d);
  return out;
}

// A tensor value, or a DTensor's local part and its placement.
struct LocalValue {
  Payload local;
  std::optional<DTensorSpec> dtensor;
};

Result<LocalValue> local_value(const Pickle& p, Ref r, const std::string& where) {
  LocalValue out;
  if (dcp::is_instance(p, r, "torch._tensor", "_rebuild_from_type_v2") && p.at(r).args != kNoRef) {
    // (_rebuild_wrapper_subclass, DTensor, (DTensor, dtype, size, stride, ...), {"_local_tensor", "_spec"})
    const auto& a = p.at(p.at(r).args).items;
    if (a.size() >= 4 && is_dtensor_class(p, a[1])) {
      const std::string dw = where + " (a DTensor)";
      const auto* sub = list_items(p, a[2]);
      std::optional<std::vector<int64_t>> shape;
      if (sub && sub->size() >= 3) shape = dcp::torch_size(p, (*sub)[2]);
      if (!shape || shape->size() > 64) return corrupt(dw + ": without its global size");
      OPTSTATE_RETURN_IF_ERROR(checked_numel(*shape).status().with_context(dw));
      // The instance's state: its __dict__, or (None, __dict__) as DTensor pickles it.
      Ref state = a[3];
      if (const auto* t = list_items(p, state); t && t->size() == 2) state = (*t)[1];
      const Ref local = p.dict_get(state, "_local_tensor");
      const Ref spec = dcp::fields_of(p, p.dict_get(state, "_spec"));
      if (local == kNoRef || spec == kNoRef) return corrupt(dw + ": without _local_tensor and _spec");
      OPTSTATE_ASSIGN_OR_RETURN(out.local, dcp::interpret_value(p, local, dw + " local tensor"));
      if (out.local.kind == Payload::Kind::kValue) return corrupt(dw + ": its local part is not a tensor");
      DTensorSpec ds;
      ds.global_shape = *shape;
      const Ref mesh = dcp::fields_of(p, p.dict_get(spec, "mesh"));
      auto coord = dcp::int_tuple(p, p.dict_get(mesh, "_coordinate_on_dim"));
      if (!coord) return corrupt(dw + ": its device mesh gives no coordinate for this rank (_coordinate_on_dim)");
      ds.coordinate = *coord;
      const auto* places = list_items(p, p.dict_get(spec, "placements"));
      if (!places || places->size() != ds.coordinate.size() || places->empty() || places->size() > 16)
        return corrupt(dw + ": placements do not match its device mesh's dims");
      for (Ref pl : *places) {
        OPTSTATE_ASSIGN_OR_RETURN(Placement x, placement(p, pl, shape->size(), dw));
        ds.placements.push_back(x);
      }
      for (int64_t c : ds.coordinate)
        if (c < 0 || c >= (int64_t{1} << 24)) return corrupt(fmt::format("{}: mesh coordinate {}", dw, c));
      out.dtensor = std::move(ds);
      return out;
    }
  }
  OPTSTATE_ASSIGN_OR_RETURN(out.local, dcp::interpret_value(p, r, where));
  return out;
}


// An AdamW param group's fields (a state_dict's group dict, or a LibTorch archive's options): lr
// (a number, or a one-element tensor the driver reads), betas, eps, weight_decay, amsgrad and
// maximize (absent: false). `tensor_betas`: betas may be one-element tensors too (torch.optim's
// Tensor betas, which a compiled step keeps so a schedule of them does not recompile it); the
// driver reads them into hyper (NaN until then).
Result<GroupSpec> adamw_group(const Pickle& p, Ref fields, const std::string& gw, bool tensor_betas = false) {
  GroupSpec spec;
  const Ref lr = p.dict_get(fields, "lr");
  if (lr == kNoRef) return corrupt(gw + ": no 'lr' (not an AdamW param group)");
  OPTSTATE_ASSIGN_OR_RETURN(spec.lr, scalar(p, lr, gw + " 'lr'"));
  auto has = [&](const char* key) { return p.dict_get(fields, key) != kNoRef; };
  OPTSTATE_RETURN_IF_ERROR(dcp::check_torch_adam_group(has, gw));  // another optimizer's group, named
  const auto* betas = list_items(p, p.dict_get(fields, "betas"));
  if (betas && betas->size() == 3)
    return corrupt(gw + ": three 'betas' (bitsandbytes' AdEMAMix, whose state1 holds two moments; Adan's): not AdamW");
  const bool numbers = betas && betas->size() == 2 && dcp::as_number(p, (*betas)[0]) && dcp::as_number(p, (*betas)[1]);
  if (!numbers && !(tensor_betas && betas && betas->size() == 2))
    return corrupt(gw + ": 'betas' is not a pair of numbers (not an AdamW param group)");
  OPTSTATE_ASSIGN_OR_RETURN(spec.beta1, scalar(p, (*betas)[0], gw + " 'betas'[0]"));
  OPTSTATE_ASSIGN_OR_RETURN(spec.beta2, scalar(p, (*betas)[1], gw + " 'betas'[1]"));
  spec.hyper.beta1 = spec.beta1.number.value_or(std::numeric_limits<double>::quiet_NaN());
  spec.hyper.beta2 = spec.beta2.number.value_or(std::numeric_limits<double>::quiet_NaN());
  OPTSTATE_ASSIGN_OR_RETURN(spec.hyper.eps, number(p, fields, "eps", gw));
  OPTSTATE_ASSIGN_OR_RETURN(spec.hyper.weight_decay, number(p, fields, "weight_decay", gw));
  OPTSTATE_ASSIGN_OR_RETURN(spec.hyper.amsgrad, flag(p, fields, "amsgrad", gw));
  OPTSTATE_ASSIGN_OR_RETURN(spec.hyper.maximize, flag(p, fields, "maximize", gw));
  // Adam's L2 decay (torch.optim.Adam: decoupled_weight_decay False; DeepSpeed's FusedAdam and
  // CPUAdam out of AdamW mode) is another update than AdamW's; without decay the two are one.
  for (const char* key : kCoupledDecayFlags)
    if (const auto d = dcp::as_bool(p, p.dict_get(fields, key)); d && !*d && spec.hyper.weight_decay != 0)
      return corrupt(fmt::format("{}: {}=False with weight_decay {}: Adam's L2 decay, not AdamW's decoupled decay",
                                 gw, key, spec.hyper.weight_decay));
  if (const auto bc = dcp::as_bool(p, p.dict_get(fields, "bias_correction")); bc && !*bc)
    return corrupt(gw + ": bias_correction=False: not AdamW's update");  // apex's / DeepSpeed's FusedAdam
  if (const auto cb = dcp::as_bool(p, p.dict_get(fields, "correct_bias")); cb && !*cb)
    return corrupt(gw + ": correct_bias=False (transformers' AdamW without bias correction): not AdamW's update");
  if (const auto c = dcp::as_bool(p, p.dict_get(fields, "caution")); c && *c)
    return corrupt(gw + ": caution=True (timm's cautious AdamW masks the update): not AdamW's update");
  if (const auto c = dcp::as_bool(p, p.dict_get(fields, "corrected_weight_decay")); c && *c && spec.hyper.weight_decay != 0)
    return corrupt(gw + ": corrected_weight_decay=True (timm's AdamW decays by lr^2 / max_lr, not lr): not AdamW's update");
  for (const auto& [name, fallback] : kAdamWFlagDefaults)
    if (const auto v = dcp::as_flag(p, p.dict_get(fields, name)); v) spec.flags.emplace(name, *v);
  return spec;
}

// ---- bitsandbytes' AdamW8bit / Adam8bit / AdamW: dcp/bnb_state.h ----

using dcp::bnb_moment;
using dcp::bnb_part_of;
using dcp::kBnbQuantState;

// A param's state fields in order, bitsandbytes' nested dict spliced in where it stands.
struct ParamFields {
  std::vector<std::pair<std::string, Ref>> fields;
  bool nested = false;  // some fields came from bitsandbytes' kBnbQuantState dict
  std::map<std::string, Ref, std::less<>> by_name;  // a hostile file may list many
  Ref get(std::string_view name) const {
    const auto it = by_name.find(name);
    return it == by_name.end() ? kNoRef : it->second;
  }
};

Result<ParamFields> param_fields(const Pickle& p, std::span<const Ref> items, const std::string& pw) {
  ParamFields out;
  auto add = [&](std::span<const Ref> kv, bool nested) -> Status {
    for (size_t f = 0; f + 1 < kv.size(); f += 2) {
      const auto name = dcp::as_string(p, kv[f]);
      if (!name) return corrupt(pw + ": a key is not a string");
      if (!nested && *name == kBnbQuantState) continue;  // spliced in below
      if (!out.by_name.emplace(*name, kv[f + 1]).second)
        return corrupt(fmt::format("{}: '{}' both in '{}' and beside it", pw, *name, kBnbQuantState));
      out.fields.emplace_back(*name, kv[f + 1]);
    }
    return {};
  };
  OPTSTATE_RETURN_IF_ERROR(add(items, false));
  for (size_t f = 0; f + 1 < items.size(); f += 2)
    if (dcp::as_string(p, items[f]) == kBnbQuantState) {
      const auto* inner = dict_items(p, items[f + 1]);
      if (!inner) return corrupt(fmt::format("{} '{}': not a dict", pw, kBnbQuantState));
      OPTSTATE_RETURN_IF_ERROR(add(*inner, true));
      out.nested = true;
    }
  return out;
}

Result<EntrySpec> bnb_entry(const Pickle& p, const ParamFields& pf, const std::string& name, const std::string& ew) {
  OPTSTATE_ASSIGN_OR_RETURN(Payload s, dcp::interpret_value(p, pf.get(name), ew));
  if (s.kind != Payload::Kind::kTensor) return corrupt(ew + ": not a tensor");
  EntrySpec e;
  if (s.tensor.dtype == DType::kF32 || s.tensor.dtype == DType::kBF16 || s.tensor.dtype == DType::kF16) {
    e.values = s.tensor;  // 32-bit state
    return e;
  }
  if (s.tensor.dtype != DType::kU8)
    return corrupt(fmt::format("{}: a {} tensor; bitsandbytes' state is fp32, or uint8 codes", ew, dtype_name(s.tensor.dtype)));
  const char n = name.back();
  const Ref absmax = pf.get(fmt::format("absmax{}", n)), qmap = pf.get(fmt::format("qmap{}", n));
  if (absmax == kNoRef && pf.get(fmt::format("max{}", n)) != kNoRef)
    return corrupt(fmt::format("{}: bitsandbytes' 8-bit state without blocks (block_wise=False: one scale per "
                               "tensor, 'max{}') is not read; optstate reads its blockwise state", ew, n));
  if (absmax == kNoRef || qmap == kNoRef)
    return corrupt(fmt::format("{}: uint8 codes without 'absmax{}' and 'qmap{}'", ew, n, n));
  OPTSTATE_ASSIGN_OR_RETURN(Payload a, dcp::interpret_value(p, absmax, fmt::format("{} 'absmax{}'", ew, n)));
  OPTSTATE_ASSIGN_OR_RETURN(Payload q, dcp::interpret_value(p, qmap, fmt::format("{} 'qmap{}'", ew, n)));
  if (a.kind != Payload::Kind::kTensor || a.tensor.dtype != DType::kF32 || a.tensor.shape.size() != 1)
    return corrupt(fmt::format("{} 'absmax{}': not a 1-d float32 tensor", ew, n));
  if (q.kind != Payload::Kind::kTensor || q.tensor.dtype != DType::kF32 || *checked_numel(q.tensor.shape) != 256)
    return corrupt(fmt::format("{} 'qmap{}': not a map of 256 float32", ew, n));
  const int64_t numel = *checked_numel(s.tensor.shape), blocks = a.tensor.shape[0];
  const int64_t block = dcp::bnb_block_size(numel, blocks);
  if (block == 0)
    return corrupt(fmt::format("{}: {} scales for {} codes, neither blocks of 256 nor of 2048", ew, blocks, numel));
  e.encoding = Encoding::kBlockwise8;
  e.codes = s.tensor;
  e.absmax = a.tensor;
  e.block_size = block;
  e.qmap = q.tensor;  // named by the driver, which compares it with the dynamic maps bit for bit
  return e;
}

// ---- LibTorch's optimizer archive (torch::save(optimizer, path) in C++) ----
//
// A TorchScript module saved by torch::serialize::OutputArchive: every archive level is a
// `__torch__[.___torch_mangle_N].Module` object (NEWOBJ + BUILD of its attributes). The optimizer's:
// {"pytorch_version": "1.5.0", "state": {<key>: {"step": int, "exp_avg": tensor, ...}},
//  "param_groups": {"param_groups/size": tensor, "param_groups/<i>": {"params/size": tensor,
//  "params/<j>": <key>, "options": {"lr", "betas", "eps", "weight_decay", "amsgrad", ...}}}},
// <key> the decimal address of the param's TensorImpl when it was saved (it pairs state and groups).

bool is_script_module(const Pickle& p, Ref r) {
  if (r == kNoRef) return false;
  const auto& v = p.at(r);
  if (v.kind != Kind::kObject || !v.newobj || v.callable == kNoRef) return false;
  const auto& c = p.at(v.callable);
  return c.kind == Kind::kGlobal && (c.s == "__torch__" || c.s.starts_with("__torch__.")) && c.name() == "Module";
}

// A module's attributes, in order (k0, v0, k1, v1, ...); nullptr when `r` is no module.
const Refs* module_attrs(const Pickle& p, Ref r) {
  if (!is_script_module(p, r)) return nullptr;
  return dict_items(p, dcp::fields_of(p, r));
}

Ref module_attr(const Pickle& p, Ref r, std::string_view key) {
  const Ref f = is_script_module(p, r) ? dcp::fields_of(p, r) : kNoRef;
  return f == kNoRef ? kNoRef : p.dict_get(f, key);
}

// 3 for ("param_groups/3", "param_groups/"); nullopt when `key` is not prefix + a decimal index.
std::optional<int64_t> index_after(std::string_view key, std::string_view prefix) {
  if (!key.starts_with(prefix) || key.size() == prefix.size() || key.size() - prefix.size() > 9) return std::nullopt;
  int64_t i = 0;
  for (char c : key.substr(prefix.size())) {
    if (c < '0' || c > '9') return std::nullopt;
    i = i * 10 + (c - '0');
  }
  if (key.size() - prefix.size() > 1 && key[prefix.size()] == '0') return std::nullopt;  // "01" is no index
  return i;
}

// The entries "<prefix><i>" of a module, which must be 0..n-1, and its "<prefix>size" count (checked
// by the driver). Other attributes go to `others`.
Result<std::vector<Ref>> indexed_attrs(const Pickle& p, Ref module, std::string_view prefix, const std::string& where,
                                       StateDict& out, std::vector<std::string>* others) {
  const auto* attrs = module_attrs(p, module);
  if (!attrs) return corrupt(where + ": not an archive module");
  std::map<int64_t, Ref> found;
  std::optional<Scalar> size;
  const std::string size_key = std::string(prefix) + "size";
  for (size_t k = 0; k + 1 < attrs->size(); k += 2) {
    const auto key = dcp::as_string(p, (*attrs)[k]);
    if (!key) return corrupt(where + ": an attribute name is not a string");
    if (*key == size_key) {
      OPTSTATE_ASSIGN_OR_RETURN(size, scalar(p, (*attrs)[k + 1], fmt::format("{} '{}'", where, *key)));
    } else if (const auto i = index_after(*key, prefix)) {
      if (!found.emplace(*i, (*attrs)[k + 1]).second) return corrupt(fmt::format("{}: '{}' twice", where, *key));
    } else if (others) {
      others->push_back(*key);
    }
  }
  if (!size) return corrupt(fmt::format("{}: no '{}'", where, size_key));
  std::vector<Ref> items;
  for (const auto& [i, r] : found) {
    if (i != static_cast<int64_t>(items.size()))
      return corrupt(fmt::format("{}: '{}{}' is missing", where, prefix, items.size()));
    items.push_back(r);
  }
  out.counts.push_back({*size, static_cast<int64_t>(items.size()), fmt::format("{} '{}'", where, size_key)});
  return items;
}

// One moment of a param's archive state: dense under its name, or 8-bit (optstate's AdamW8bit) as
// "<moment>_codes" + "<moment>_absmax" with the state's "block_size". Absent: nullopt.
Result<std::optional<EntrySpec>> archive_moment(const Pickle& p, Ref st, const std::string& moment,
                                                std::optional<std::vector<int64_t>>& shape, const std::string& pw) {
  const std::string ew = fmt::format("{} '{}'", pw, moment);
  const Ref dense = module_attr(p, st, moment), codes = module_attr(p, st, moment + "_codes");
  if (dense == kNoRef && codes == kNoRef) return std::optional<EntrySpec>();
  if (dense != kNoRef && codes != kNoRef) return corrupt(ew + ": both dense and 8-bit");
  EntrySpec e;
  if (dense != kNoRef) {
    OPTSTATE_ASSIGN_OR_RETURN(Payload pl, dcp::interpret_value(p, dense, ew));
    if (pl.kind != Payload::Kind::kTensor) return corrupt(ew + ": not a tensor");
    if (pl.tensor.dtype != DType::kF32 && pl.tensor.dtype != DType::kBF16 && pl.tensor.dtype != DType::kF16)
      return corrupt(fmt::format("{}: a {} tensor; dense state is fp32, bf16 or fp16", ew, dtype_name(pl.tensor.dtype)));
    OPTSTATE_RETURN_IF_ERROR(same_shape(shape, pl.tensor.shape, ew));
    e.values = pl.tensor;
    return std::optional<EntrySpec>(std::move(e));
  }
  const std::string cw = ew + "_codes", aw = ew + "_absmax";
  const Ref absmax = module_attr(p, st, moment + "_absmax");
  if (absmax == kNoRef) return corrupt(fmt::format("{}: without '{}_absmax'", cw, moment));
  const auto block = dcp::as_number(p, module_attr(p, st, "block_size"));
  if (!block || *block < 1 || *block > (1 << 20) || *block != static_cast<double>(static_cast<int64_t>(*block)))
    return corrupt(pw + ": 8-bit moments without an integer 'block_size' in [1, 2^20]");
  OPTSTATE_ASSIGN_OR_RETURN(Payload c, dcp::interpret_value(p, codes, cw));
  OPTSTATE_ASSIGN_OR_RETURN(Payload a, dcp::interpret_value(p, absmax, aw));
  if (c.kind != Payload::Kind::kTensor || c.tensor.dtype != DType::kU8) return corrupt(cw + ": not a uint8 tensor");
  if (a.kind != Payload::Kind::kTensor || a.tensor.dtype != DType::kF32) return corrupt(aw + ": not a float32 tensor");
  const auto b = static_cast<int64_t>(*block);
  const int64_t numel = *checked_numel(c.tensor.shape), blocks = *checked_numel(a.tensor.shape);
  if (blocks != (numel + b - 1) / b)
    return corrupt(fmt::format("{}: {} scales for {} codes in blocks of {} (needs {})", aw, blocks, numel, b, (numel + b - 1) / b));
  OPTSTATE_RETURN_IF_ERROR(same_shape(shape, c.tensor.shape, cw));
  e.encoding = Encoding::kBlockwise8;
  e.codes = c.tensor;
  e.absmax = a.tensor;
  e.block_size = b;
  e.qmap_name = std::string(qmap_name(moment == kExpAvg ? QMap::kDynamicSigned : QMap::kDynamicUnsigned));
  return std::optional<EntrySpec>(std::move(e));
}

// Option fields the canonical state reads or that say nothing it needs (optstate's 8-bit layout).
const std::set<std::string, std::less<>> kArchiveOptions = {"lr",      "betas",    "eps",        "weight_decay",
                                                            "amsgrad", "maximize", "block_size", "min_8bit_size"};

Result<StateDict> interpret_libtorch_archive(const Pickle& p, const std::string& where) {
  StateDict out;
  out.libtorch = true;
  const Ref root = p.root();
  const auto version = dcp::as_string(p, module_attr(p, root, "pytorch_version"));
  if (!version)
    return corrupt(where + ": a TorchScript archive, but not LibTorch's optimizer archive (no 'pytorch_version'; "
                           "what C++'s torch::save(optimizer, path) writes)");
  if (*version != "1.5.0")
    return unsupported(fmt::format("{}: LibTorch optimizer archive of layout '{}' (known: 1.5.0)", where, *version));
  const std::string ow = where + " (LibTorch optimizer archive)";
  const Ref groups_module = module_attr(p, root, "param_groups"), state_module = module_attr(p, root, "state");
  if (!is_script_module(p, groups_module)) return corrupt(ow + ": no 'param_groups' module");
  if (!is_script_module(p, state_module)) return corrupt(ow + ": no 'state' module");
  if (const auto* attrs = module_attrs(p, root))
    for (size_t k = 0; k + 1 < attrs->size(); k += 2)
      if (const auto key = dcp::as_string(p, (*attrs)[k]); !key || (*key != "pytorch_version" && *key != "param_groups" && *key != "state"))
        out.not_read.push_back(fmt::format("'{}'", key ? *key : "?"));

  OPTSTATE_ASSIGN_OR_RETURN(const std::vector<Ref> groups,
                            indexed_attrs(p, groups_module, "param_groups/", ow + " param_groups", out, nullptr));
  if (groups.empty()) return corrupt(ow + ": no param groups");
  std::map<std::string, std::pair<int64_t, int>, std::less<>> member_of_key;  // key -> (id, group)
  std::vector<std::pair<int64_t, int>> members;                               // in id order
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::string gw = fmt::format("{} param group {}", ow, g);
    std::vector<std::string> others;
    OPTSTATE_ASSIGN_OR_RETURN(const std::vector<Ref> keys, indexed_attrs(p, groups[g], "params/", gw, out, &others));
    const Ref options = module_attr(p, groups[g], "options");
    const auto* opts = module_attrs(p, options);
    if (!opts) return corrupt(gw + ": no 'options' module");
    for (const std::string& o : others)
      if (o != "options") out.not_read.push_back(fmt::format("param group {} '{}'", g, o));
    const Ref fields = dcp::fields_of(p, options);
    OPTSTATE_ASSIGN_OR_RETURN(GroupSpec spec, adamw_group(p, fields, gw));
    for (size_t k = 0; k + 1 < opts->size(); k += 2) {
      const auto key = dcp::as_string(p, (*opts)[k]);
      if (!key || !kArchiveOptions.count(*key)) out.not_read.push_back(fmt::format("param group {} option '{}'", g, key ? *key : "?"));
    }
    for (size_t j = 0; j < keys.size(); ++j) {
      const auto key = dcp::as_string(p, keys[j]);
      if (!key) return corrupt(fmt::format("{}: 'params/{}' is not a string", gw, j));
      const auto id = static_cast<int64_t>(members.size());
      if (!member_of_key.emplace(*key, std::pair{id, static_cast<int>(g)}).second)
        return corrupt(fmt::format("{}: param '{}' is listed twice", gw, *key));
      members.emplace_back(id, static_cast<int>(g));
    }
    out.groups.push_back(std::move(spec));
  }

  const auto* states = module_attrs(p, state_module);
  if (!states) return corrupt(ow + ": 'state' is not a module");
  std::map<int64_t, ParamSpec> params;
  for (size_t k = 0; k + 1 < states->size(); k += 2) {
    const auto key = dcp::as_string(p, (*states)[k]);
    const auto member = key ? member_of_key.find(*key) : member_of_key.end();
    if (member == member_of_key.end())
      return corrupt(fmt::format("{}: state of param '{}', which no param group lists", ow, key ? *key : "?"));
    const auto [id, g] = member->second;
    const std::string pw = fmt::format("{} state of param {} (key {})", ow, id, *key);
    const Ref st = (*states)[k + 1];
    const auto* fields = module_attrs(p, st);
    if (!fields) return corrupt(pw + ": not an archive module");
    ParamSpec spec;
    spec.fqn = std::to_string(id);
    spec.id = id;
    spec.group = g;
    const Ref step = module_attr(p, st, "step");
    if (step == kNoRef) return corrupt(pw + ": no 'step'");
    OPTSTATE_ASSIGN_OR_RETURN(spec.step, scalar(p, step, pw + " 'step'"));
    std::optional<std::vector<int64_t>> shape;
    for (const char* moment : {kExpAvg, kExpAvgSq, kMaxExpAvgSq}) {
      OPTSTATE_ASSIGN_OR_RETURN(auto e, archive_moment(p, st, moment, shape, pw));
      if (!e) continue;
      out.eight = out.eight || e->encoding == Encoding::kBlockwise8;
      spec.entries.emplace(moment, std::move(*e));
    }
    if (!spec.entries.count(kExpAvg) || !spec.entries.count(kExpAvgSq))
      return corrupt(pw + ": no 'exp_avg' and 'exp_avg_sq'");
    for (size_t f = 0; f + 1 < fields->size(); f += 2) {
      const auto name = dcp::as_string(p, (*fields)[f]);
      const bool known = name && (*name == "step" || *name == "block_size" || is_moment(*name) ||
                                  moment_of(*name, "_codes") || moment_of(*name, "_absmax"));
      if (!known) out.not_read.push_back(fmt::format("state of param {} '{}'", id, name ? *name : "?"));
    }
    spec.shape = *shape;
    params.emplace(id, std::move(spec));
  }
  for (auto& [id, spec] : params) out.groups[static_cast<size_t>(spec.group)].params.push_back(spec.fqn);
  out.members = members.size();
  out.stateless = members.size() - params.size();
  for (auto& [id, spec] : params) out.params.push_back(std::move(spec));
  return out;
}
}  // namespace

Result<FlatUnits> match_flat_units(const std::vector<std::string>& names, const std::vector<int64_t>& numels,
                                   const std::vector<int64_t>& shard, int64_t world, const std::string& where) {
  const size_t m = names.size(), units = shard.size();
  if (numels.size() != m || units == 0 || world < 1)
    return invalid_argument(fmt::format("{}: no FSDP units or params to match", where));
  if (units > 10000)  // the search recurses once per unit
    return corrupt(fmt::format("{}: {} FSDP units; optstate matches up to 10000", where, units));
  std::vector<int64_t> prefix(m + 1, 0);  // element sums; sizes come from checked shapes
  for (size_t j = 0; j < m; ++j) {
    if (numels[j] < 0 || numels[j] > (int64_t{1} << 50) || prefix[j] > (int64_t{1} << 60))
      return corrupt(fmt::format("{}: param sizes out of range", where));
    prefix[j + 1] = prefix[j] + numels[j];
  }
  // Modules: every proper dot-prefix of a name, with the params under it (a module's params are
  // consecutive in module order; one that is not is no candidate). ends[p]: where the modules whose
  // first param is p end.
  std::map<std::string, std::pair<size_t, size_t>> range;  // module -> [first, last]
  std::map<std::string, size_t> count;
  for (size_t j = 0; j < m; ++j)
    for (size_t dot = names[j].find('.'); dot != std::string::npos; dot = names[j].find('.', dot + 1)) {
      const std::string mod = names[j].substr(0, dot);
      auto [it, fresh] = range.try_emplace(mod, j, j);
      if (!fresh) it->second.second = j;
      ++count[mod];
    }
  std::vector<std::vector<size_t>> ends(m);
  for (const auto& [mod, r] : range)
    if (count[mod] == r.second - r.first + 1) ends[r.first].push_back(r.second + 1);
  for (auto& e : ends) {
    std::sort(e.begin(), e.end());
    e.erase(std::unique(e.begin(), e.end()), e.end());
  }
  auto fits = [&](int64_t elems, int64_t s) { return elems > 0 && (elems + world - 1) / world == s; };

  // Depth-first over where each wrapped unit starts and which module it is, counting whole splits
  // (two are enough to refuse); bounded, since a hostile file could make it search long.
  // Splits that put every param in the same unit count once (an unwrapped first block in the
  // root's unit is the same split as that block wrapped alone).
  struct Found {
    int solutions = 0;
    std::vector<int> unit_of;  // the first split's
    int64_t steps = 0;
  } found;
  std::vector<std::pair<size_t, size_t>> runs;  // [begin, end) of each wrapped unit so far
  constexpr int64_t kMaxSteps = 20'000'000;  // candidates tried: well under a second
  // root: unit 0 is the root's (the params no run holds), the runs are units 1..; else every unit is a run.
  std::function<void(bool, size_t, size_t, int64_t)> search = [&](bool root, size_t u, size_t pos, int64_t sum) {
    if (found.solutions > 1 || found.steps > kMaxSteps) return;
    if (u == units) {
      const int64_t rest = prefix[m] - sum;
      if (root ? fits(rest, shard[0]) : rest == 0) {
        std::vector<int> unit_of(m, 0);
        for (size_t k = 0; k < runs.size(); ++k)
          for (size_t j = runs[k].first; j < runs[k].second; ++j) unit_of[j] = static_cast<int>(k + (root ? 1 : 0));
        if (found.solutions == 0) {
          found.unit_of = std::move(unit_of);
          found.solutions = 1;
        } else if (unit_of != found.unit_of) {
          found.solutions = 2;
        }
      }
      return;
    }
    const size_t last_start = root ? m : pos + 1;  // without a root unit, no param is skipped
    for (size_t p = pos; p < std::min(last_start, m) && ++found.steps <= kMaxSteps; ++p)
      for (size_t end : ends[p])
        if (++found.steps <= kMaxSteps && fits(prefix[end] - prefix[p], shard[u])) {
          runs.emplace_back(p, end);
          search(root, u + 1, end, sum + prefix[end] - prefix[p]);
          runs.pop_back();
        }
  };
  search(true, 1, 0, 0);
  search(false, 0, 0, 0);
  if (found.steps > kMaxSteps)
    return corrupt(fmt::format("{}: too many ways to split {} params into {} FSDP units to try them all", where, m, units));
  if (found.solutions == 0)
    return corrupt(fmt::format("{}: the model's {} params do not split into the optimizer's {} FSDP units (elements "
                               "per rank {}) as FSDP flattens them: each unit one module's params, the root's the "
                               "rest (nested units, or another model's files?)", where, m, units, fmt::join(shard, ", ")));
  if (found.solutions > 1)
    return corrupt(fmt::format("{}: the model's {} params split into the optimizer's {} FSDP units in more than one "
                               "way; which param is where cannot be told", where, m, units));
  FlatUnits out;
  out.unit_of = std::move(found.unit_of);
  out.offset.assign(m, 0);
  out.numel.assign(units, 0);
  for (size_t j = 0; j < m; ++j) {
    const auto u = static_cast<size_t>(out.unit_of[j]);
    out.offset[j] = out.numel[u];
    out.numel[u] += numels[j];
  }
  return out;
}

std::string model_others_text(std::string_view model_key, size_t others) {
  return fmt::format("{} ({} entr{} besides the optimized params' weights)", model_key, others, others == 1 ? "y" : "ies");
}

Result<Box> dtensor_box(const DTensorSpec& spec, const std::vector<int64_t>& mesh_shape, const std::string& where) {
  if (mesh_shape.size() != spec.placements.size() || spec.coordinate.size() != spec.placements.size())
    return corrupt(fmt::format("{}: a DTensor over {} mesh dims, on a mesh of {}", where, spec.placements.size(),
                               mesh_shape.size()));
  Box b;
  b.offsets.assign(spec.global_shape.size(), 0);
  b.sizes = spec.global_shape;
  for (size_t i = 0; i < mesh_shape.size(); ++i) {
    const int64_t n = mesh_shape[i], c = spec.coordinate[i];
    if (n < 1 || c < 0 || c >= n)
      return corrupt(fmt::format("{}: mesh coordinate {} on a mesh dim of {}", where, c, n));
    if (spec.placements[i].kind == Placement::Kind::kReplicate) {
      b.replica = b.replica || c != 0;
      continue;
    }
    const auto d = static_cast<size_t>(spec.placements[i].dim);
    if (d >= b.sizes.size()) return corrupt(fmt::format("{}: Shard({}) of a {}-d tensor", where, d, b.sizes.size()));
    const int64_t cur = b.sizes[d], piece = (cur + n - 1) / n, start = piece * c;
    if (start >= cur) {
      b.offsets[d] += cur;
      b.sizes[d] = 0;
    } else {
      b.offsets[d] += start;
      b.sizes[d] = std::min(piece, cur - start);
    }
  }
  return b;
}

Result<ModelDict> interpret_model_dict(const Pickle& p, const std::string& where) {
  return interpret_model_dict(p, p.root(), where);
}

Result<ModelDict> interpret_model_dict(const Pickle& p, Ref dict, const std::string& where) {
  const auto* items = dict_items(p, dict);
  if (!items) return corrupt(where + ": data.pkl is not a dict, so not a model's state_dict");
  ModelDict out;
  for (size_t k = 0; k + 1 < items->size(); k += 2) {
    const auto name = dcp::as_string(p, (*items)[k]);
    if (!name) return corrupt(where + ": a key is not a string, so not a model's state_dict");
    const Ref v = (*items)[k + 1];
    auto lv = local_value(p, v, fmt::format("{} ['{}']", where, *name));
    if (!lv.ok() || lv->local.kind != Payload::Kind::kTensor) {
      ++out.others;
      continue;
    }
    if (!out.by_name.emplace(*name, out.tensors.size()).second)
      return corrupt(fmt::format("{}: '{}' is listed twice", where, *name));
    out.tensors.push_back({*name, lv->local.tensor, lv->dtensor, v});
  }
  return out;
}

std::string ModelSource::key() const {
  std::vector<std::string> keys;
  for (const Part& part : parts) keys.push_back(part.key);
  return fmt::format("{}", fmt::join(keys, ", "));
}

Result<std::optional<ModelSource>> megatron_model_chunks(const Pickle& p, const std::string& where) {
  const auto* items = dict_items(p, p.root());
  if (!items || p.dict_get(p.root(), "model") != kNoRef) return std::optional<ModelSource>();
  std::map<int64_t, Ref> chunks;
  for (size_t k = 0; k + 1 < items->size(); k += 2) {
    const auto key = dcp::as_string(p, (*items)[k]);
    if (!key || !key->starts_with("model") || key->size() < 6 || key->size() > 9 ||
        key->find_first_not_of("0123456789", 5) != std::string::npos)
      continue;
    if (!dict_items(p, (*items)[k + 1]))
      return corrupt(fmt::format("{} ['{}']: not a dict (a model chunk's state_dict)", where, *key));
    chunks.emplace(std::stoll(key->substr(5)), (*items)[k + 1]);
  }
  if (chunks.empty()) return std::optional<ModelSource>();
  ModelSource out;
  for (const auto& [i, ref] : chunks) {
    if (i != static_cast<int64_t>(out.parts.size()))
      return corrupt(fmt::format("{}: ['model{}'] without ['model{}'] (a virtual pipeline's chunks are model0, "
                                 "model1, ...)", where, i, out.parts.size()));
    out.parts.push_back({ref, fmt::format("['model{}']", i), fmt::format("model{}.", i)});
  }
  return std::optional<ModelSource>(std::move(out));
}

Result<ModelDict> interpret_model_source(const Pickle& p, const ModelSource& models, const std::string& where) {
  ModelDict out;
  for (const ModelSource::Part& part : models.parts) {
    OPTSTATE_ASSIGN_OR_RETURN(ModelDict md, interpret_model_dict(p, part.dict, where + " " + part.key));
    for (ModelTensor& t : md.tensors) {
      t.name = part.prefix + t.name;
      if (!out.by_name.emplace(t.name, out.tensors.size()).second)
        return corrupt(fmt::format("{} {}: '{}' is listed twice", where, part.key, t.name));
      out.tensors.push_back(std::move(t));
    }
    out.others += md.others;
  }
  return out;
}

std::vector<size_t> param_candidates(const ModelDict& md) {
  bool dtensors = false;
  for (const ModelTensor& t : md.tensors) dtensors = dtensors || t.dtensor.has_value();
  std::vector<size_t> out;
  std::set<std::tuple<std::string, int64_t, std::vector<int64_t>>> storages;
  std::set<Ref> objects;
  for (size_t i = 0; i < md.tensors.size(); ++i) {
    const ModelTensor& t = md.tensors[i];
    if (dtensors ? !t.dtensor : !dtype_info(t.tensor.dtype).is_float || is_norm_buffer(t.name)) continue;
    if (!objects.insert(t.ref).second) continue;  // tied: one object under two names
    if (!t.dtensor && !storages.emplace(t.tensor.storage_key, t.tensor.offset, t.tensor.shape).second) continue;
    out.push_back(i);
  }
  return out;
}

ModelNames names_from_model(const ModelDict& md, const std::vector<std::vector<int64_t>>& member_ids,
                            const std::map<int64_t, std::vector<int64_t>>& shape_of) {
  size_t members = 0;
  for (const auto& ids : member_ids) members += ids.size();
  if (members == 0) return {{}, "the optimizer lists no params"};
  std::vector<std::vector<int64_t>> shapes;
  std::vector<const std::string*> names;
  for (const size_t i : param_candidates(md)) {
    const ModelTensor& t = md.tensors[i];
    shapes.push_back(t.dtensor ? t.dtensor->global_shape : t.tensor.shape);
    names.push_back(&t.name);
  }
  std::vector<std::vector<std::optional<std::vector<int64_t>>>> groups(member_ids.size());
  for (size_t g = 0; g < member_ids.size(); ++g)
    for (int64_t id : member_ids[g]) {
      const auto it = shape_of.find(id);
      groups[g].push_back(it == shape_of.end() ? std::nullopt : std::optional(it->second));
    }
  ModelPlacement placed = place_params_in_model(groups, shapes);
  if (!placed.why.empty()) return {{}, placed.why};
  ModelNames out;
  for (size_t g = 0; g < member_ids.size(); ++g)
    for (size_t i = 0; i < member_ids[g].size(); ++i) out.by_id[member_ids[g][i]] = *names[placed.tensor_of[g][i]];
  return out;
}

namespace {

// One optimizer state_dict's param groups and per-param state, as torch numbers them (ids 0.. in
// group order, or names where the state is keyed by fqn); group indices are this dict's own.
struct OptimizerPart {
  std::map<int64_t, std::pair<int, std::string>> members;  // id -> (group, name)
  std::map<int64_t, ParamSpec> params;                      // those with state
  std::vector<std::vector<int64_t>> group_ids;              // each group's param ids, in its order
  bool keyed_by_name = false;                               // params listed by fqn, not by number
  bool named_in_groups = false;                             // some group has param_names
  bool torchao_groups = true;                               // lr a tensor, no 'maximize': torchao's
};

// The dict at `opt` (`ow` names it in errors): its groups appended to out.groups, what it holds
// beyond the state to out.not_read, the state's kinds (eight, torchao, bnb) to out's flags. An
// optimizer of one param among others (StateDict::per_param): `group_base` numbers its group as
// the state's in not_read, and `of_param` names the param there.
Status interpret_optimizer(const Pickle& p, Ref opt, const std::string& ow, StateDict& out, OptimizerPart& part,
                           size_t group_base = 0, std::string_view of_param = {}) {
  // Param groups: hyperparameters, member ids and (torch >= 2.6, params given by name) their names.
  const auto* groups = list_items(p, p.dict_get(opt, "param_groups"));
  if (!groups || groups->empty()) return corrupt(ow + ": 'param_groups' is not a non-empty list");
  auto& [members, params, group_ids, keyed_by_name, named_in_groups, torchao_groups] = part;
  std::map<std::string, int64_t, std::less<>> id_of_name;  // by name: fqn -> its number
  std::set<std::string> names;
  std::vector<GroupInfo> info(groups->size());
  group_ids.assign(groups->size(), {});
  for (size_t g = 0; g < groups->size(); ++g) {
    const Ref gr = (*groups)[g];
    const std::string gw = fmt::format("{} param group {}", ow, g);
    if (!dict_items(p, gr)) return corrupt(gw + ": not a dict");
    OPTSTATE_ASSIGN_OR_RETURN(GroupSpec spec, adamw_group(p, gr, gw, /*tensor_betas=*/true));
    // torchao's optimizers (_AdamBase) keep lr as a tensor and have no 'maximize', which every
    // torch.optim.AdamW state_dict since torch 1.11 has.
    torchao_groups = torchao_groups && spec.lr.tensor && p.dict_get(gr, "maximize") == kNoRef;
    if (const Ref b = p.dict_get(gr, "block_size"); b != kNoRef) {
      const auto v = dcp::as_number(p, b);
      if (!v || *v < 1 || *v > (1 << 20) || *v != static_cast<double>(static_cast<int64_t>(*v)))
        return corrupt(gw + ": 'block_size' is not an integer in [1, 2^20]");
      info[g].block = static_cast<int64_t>(*v);
      out.eight = true;
      torchao_groups = false;  // optstate's AdamW8bit
    }
    for (auto [field, name] : {std::pair{"exp_avg_qmap", &info[g].signed_map},
                               std::pair{"exp_avg_sq_qmap", &info[g].unsigned_map}}) {
      const Ref r = p.dict_get(gr, field);
      if (r == kNoRef) continue;
      auto v = dcp::as_string(p, r);
      if (!v || !qmap_from_name(*v).ok()) return corrupt(fmt::format("{}: '{}' is not a known map name", gw, field));
      *name = *v;
    }
    const auto* ids = list_items(p, p.dict_get(gr, "params"));
    if (!ids) return corrupt(gw + ": 'params' is not a list");
    std::optional<std::vector<std::string>> pnames;
    if (const Ref pn = p.dict_get(gr, "param_names"); pn != kNoRef) {
      named_in_groups = true;
      pnames = dcp::as_string_list(p, pn);
      if (!pnames || pnames->size() != ids->size())
        return corrupt(gw + ": 'param_names' is not a list of strings as long as 'params'");
    }
    for (size_t i = 0; i < ids->size(); ++i) {
      const auto& idv = p.at((*ids)[i]);
      // Params by number (optimizer.state_dict()), or by name (get_optimizer_state_dict,
      // FSDP.optim_state_dict: state keyed by fqn); all of one kind in a file.
      const bool by_name = idv.kind == Kind::kStr;
      if (!members.empty() && by_name != keyed_by_name)
        return corrupt(gw + ": params listed by number and by name in one state_dict");
      keyed_by_name = by_name;
      if (!by_name && (idv.kind != Kind::kInt || idv.i < 0))
        return corrupt(gw + ": a param is neither a non-negative integer id nor a name");
      const int64_t id = by_name ? static_cast<int64_t>(members.size()) : idv.i;  // by name: numbered in order
      std::string name = by_name ? idv.s : pnames ? (*pnames)[i] : std::to_string(id);
      if (name.empty()) return corrupt(fmt::format("{}: param {} has an empty name", gw, id));
      if (!members.emplace(id, std::pair{static_cast<int>(g), name}).second)
        return corrupt(fmt::format("{}: param id {} is listed twice", gw, id));
      group_ids[g].push_back(id);
      if (!names.insert(name).second) return corrupt(fmt::format("{}: param name '{}' is listed twice", gw, name));
      if (by_name) id_of_name.emplace(name, id);
    }
    // Its other keys (a scheduler's initial_lr): plain values and one-element float32 tensors are
    // kept (GroupSpec::extras), anything else is named as not read.
    const auto& gitems = *dict_items(p, gr);
    for (size_t k = 0; k + 1 < gitems.size(); k += 2) {
      const auto key = dcp::as_string(p, gitems[k]);
      if (key && dcp::known_group_key(*key)) continue;
      if (key) {
        if (auto v = dcp::as_group_value(p, gitems[k + 1])) {
          spec.extras.push_back({*key, std::move(*v), std::nullopt});
          continue;
        }
        const Result<Scalar> t = scalar(p, gitems[k + 1], gw);
        if (t.ok() && t->tensor && t->tensor->dtype == DType::kF32 && t->tensor->shape.size() <= 1) {
          GroupValue v;
          v.kind = GroupValue::Kind::kTensor;
          v.shape = t->tensor->shape;
          spec.extras.push_back({*key, std::move(v), t->tensor});
          continue;
        }
      }
      out.not_read.push_back(fmt::format("param group {} '{}'", group_base + g, key ? *key : "?"));
    }
    out.groups.push_back(std::move(spec));
  }

  // Per-param state, by id.
  const Ref state = p.dict_get(opt, "state");
  const auto* sitems = dict_items(p, state);
  if (!sitems) return corrupt(ow + ": 'state' is not a dict");
  for (size_t k = 0; k + 1 < sitems->size(); k += 2) {
    const auto& key = p.at((*sitems)[k]);
    int64_t id = key.i;
    if (keyed_by_name) {
      const auto it = key.kind == Kind::kStr ? id_of_name.find(key.s) : id_of_name.end();
      if (it == id_of_name.end())
        return corrupt(fmt::format("{}: state of '{}', which no param group lists", ow,
                                   key.kind == Kind::kStr ? key.s : std::string("a key that is not a name")));
      id = it->second;
    } else if (key.kind != Kind::kInt) {
      return corrupt(ow + ": a 'state' key is not a param id");
    }
    const auto member = members.find(id);
    if (member == members.end())
      return corrupt(fmt::format("{}: state of param id {}, which no param group lists", ow, id));
    const auto& [g, fqn] = member->second;
    const std::string pw = fmt::format("{} state[{}] (param '{}')", ow, keyed_by_name ? "'" + fqn + "'" : std::to_string(id), fqn);
    const Ref ps = (*sitems)[k + 1];
    const auto* fields = dict_items(p, ps);
    if (!fields) return corrupt(pw + ": not a dict");
    ParamSpec spec;
    spec.fqn = fqn;
    spec.id = id;
    spec.group = g;
    std::optional<std::vector<int64_t>> shape;
    bool has_step = false;
    OPTSTATE_ASSIGN_OR_RETURN(const ParamFields pf, param_fields(p, *fields, pw));
    for (const auto& [field, v] : pf.fields) {
      const std::string* name = &field;
      const std::string ew = fmt::format("{} '{}'", pw, *name);
      if (*name == "step") {
        OPTSTATE_ASSIGN_OR_RETURN(spec.step, scalar(p, v, ew));
        has_step = true;
      } else if (is_moment(*name)) {
        OPTSTATE_ASSIGN_OR_RETURN(LocalValue lv, local_value(p, v, ew));
        const Payload& pl = lv.local;
        EntrySpec e;
        e.dtensor = lv.dtensor;
        e.ref = v;
        if (pl.kind == Payload::Kind::kTensor) {
          if (pl.tensor.dtype != DType::kF32 && pl.tensor.dtype != DType::kBF16 && pl.tensor.dtype != DType::kF16)
            return corrupt(fmt::format("{}: a {} tensor; dense state is fp32, bf16 or fp16", ew, dtype_name(pl.tensor.dtype)));
          OPTSTATE_RETURN_IF_ERROR(same_shape(shape, lv.dtensor ? lv.dtensor->global_shape : pl.tensor.shape, ew));
          e.values = pl.tensor;
        } else if (pl.kind == Payload::Kind::kOptimState8bit) {
          // torchao: codes in the param's shape, one scale per block, the map itself.
          out.torchao = true;
          if (out.torchao_package.empty()) out.torchao_package = pl.torchao_package;
          const int64_t codes = pl.elements(), blocks = *checked_numel(pl.scale.shape);
          OPTSTATE_ASSIGN_OR_RETURN(const int64_t claimed, checked_numel(pl.claimed_shape));
          if (claimed != codes)
            return corrupt(fmt::format("{}: torchao's state of {} elements with {} codes", ew, claimed, codes));
          if (blocks <= 0 || codes % blocks) return corrupt(ew + ": codes are not a whole number of blocks");
          OPTSTATE_RETURN_IF_ERROR(same_shape(shape, lv.dtensor ? lv.dtensor->global_shape : pl.claimed_shape, ew));
          e.encoding = Encoding::kBlockwise8;
          e.codes = pl.codes;
          e.absmax = pl.scale;
          e.block_size = codes / blocks;
          if (pl.claimed_dtype && (*pl.claimed_dtype == DType::kF32 || *pl.claimed_dtype == DType::kBF16 ||
                                   *pl.claimed_dtype == DType::kF16))
            e.apparent_dtype = pl.claimed_dtype;
          if (pl.fp8) {
            e.fp8 = true;  // AdamWFp8: its state is AdamW's once read (fp32 values)
          } else if (pl.bits == 4) {
            e.bits = 4;  // AdamW4bit: the same, through its 16-entry map
            e.qmap = pl.qmap;
          } else {
            e.qmap = pl.qmap;
            out.eight = true;
          }
        } else {
          return corrupt(ew + ": neither a tensor nor torchao's OptimState8bit, OptimState4bit or OptimStateFp8");
        }
        if (!spec.entries.emplace(*name, std::move(e)).second) return corrupt(ew + ": listed twice");
      } else if (const auto moment = bnb_moment(*name)) {
        OPTSTATE_ASSIGN_OR_RETURN(EntrySpec e, bnb_entry(p, pf, *name, ew));
        OPTSTATE_RETURN_IF_ERROR(same_shape(shape, e.encoding == Encoding::kDense ? e.values.shape : e.codes.shape, ew));
        if (e.encoding == Encoding::kBlockwise8) out.eight = true;
        out.bnb = true;
        if (!out.bnb_nested) out.bnb_nested = pf.nested;
        if (!spec.entries.emplace(*moment, std::move(e)).second)
          return corrupt(fmt::format("{}: '{}' twice (as '{}' and bitsandbytes' '{}')", pw, *moment, *moment, *name));
      } else if (const auto of = bnb_part_of(*name)) {
        if (pf.get(*of) == kNoRef) return corrupt(fmt::format("{}: without '{}'", ew, *of));
      } else if (const auto base = moment_of(*name, "_codes")) {
        // optstate's AdamW8bit (DESIGN §6): plain codes and absmax tensors, block and maps in the group.
        const Ref absmax = pf.get(*base + "_absmax");
        if (absmax == kNoRef) return corrupt(fmt::format("{}: without '{}_absmax'", ew, *base));
        if (info[static_cast<size_t>(g)].block == 0)
          return corrupt(ew + ": 8-bit codes, but the param group has no block_size (optstate's AdamW8bit records it)");
        OPTSTATE_ASSIGN_OR_RETURN(Payload c, dcp::interpret_value(p, v, ew));
        OPTSTATE_ASSIGN_OR_RETURN(Payload a, dcp::interpret_value(p, absmax, fmt::format("{} '{}_absmax'", pw, *base)));
        if (c.kind != Payload::Kind::kTensor || c.tensor.dtype != DType::kU8) return corrupt(ew + ": not a uint8 tensor");
        if (a.kind != Payload::Kind::kTensor || a.tensor.dtype != DType::kF32)
          return corrupt(fmt::format("{} '{}_absmax': not a float32 tensor", pw, *base));
        const int64_t block = info[static_cast<size_t>(g)].block;
        const int64_t numel = *checked_numel(c.tensor.shape), blocks = *checked_numel(a.tensor.shape);
        if (blocks != (numel + block - 1) / block)
          return corrupt(fmt::format("{}: {} scales for {} codes in blocks of {} (needs {})", ew, blocks, numel, block,
                                     (numel + block - 1) / block));
        OPTSTATE_RETURN_IF_ERROR(same_shape(shape, c.tensor.shape, ew));
        EntrySpec e;
        e.encoding = Encoding::kBlockwise8;
        e.codes = c.tensor;
        e.absmax = a.tensor;
        e.block_size = block;
        e.qmap_name = *base == kExpAvg ? info[static_cast<size_t>(g)].signed_map : info[static_cast<size_t>(g)].unsigned_map;
        if (!spec.entries.emplace(*base, std::move(e)).second)
          return corrupt(fmt::format("{}: '{}' is both dense and 8-bit", pw, *base));
        out.eight = true;
      } else if (const auto base = moment_of(*name, "_absmax")) {
        if (pf.get(*base + "_codes") == kNoRef) return corrupt(fmt::format("{}: without '{}_codes'", ew, *base));
      } else {
        out.not_read.push_back(fmt::format("state[{}] '{}'{}", keyed_by_name ? "'" + fqn + "'" : std::to_string(id), *name,
                                           of_param.empty() ? "" : fmt::format(" (param '{}')", of_param)));
      }
    }
    if (spec.entries.empty()) continue;  // only a step: nothing to carry
    if (!has_step) return corrupt(pw + ": moments without a 'step'");
    for (const char* m : {kExpAvg, kExpAvgSq})
      if (!spec.entries.count(m))
        return corrupt(pf.get("state1") != kNoRef
                           ? pw + ": bitsandbytes' 'state1' without 'state2': a one-state optimizer (Lion, "
                                  "SGD with momentum, RMSprop, Adagrad), not AdamW"
                           : fmt::format("{}: no '{}' (AdamW keeps exp_avg and exp_avg_sq)", pw, m));
    spec.shape = *shape;
    if (!params.emplace(id, std::move(spec)).second) return corrupt(pw + ": listed twice");
  }

  // DeepSpeed's FusedAdam (its groups hold 'bias_correction' and a 'step' that stays as it was
  // made) counts a group's steps on the state of the last param it steps and steps all of them with
  // that count (fused_adam.py: `state['step'] += 1` after its loop over the group's params, on the
  // loop's last state); the others keep the count they were made with. Where a group's steps
  // differ, its params are read at its last param's, the count its next step goes on from.
  for (size_t g = 0; g < groups->size(); ++g) {
    const Ref gr = (*groups)[g];
    if (p.dict_get(gr, "bias_correction") == kNoRef || p.dict_get(gr, "step") == kNoRef) continue;
    std::vector<ParamSpec*> stepped;
    for (int64_t id : group_ids[g])
      if (auto it = params.find(id); it != params.end()) stepped.push_back(&it->second);
    if (stepped.size() < 2 || !std::all_of(stepped.begin(), stepped.end(), [](const ParamSpec* s) { return s->step.number.has_value(); }))
      continue;
    const double last = *stepped.back()->step.number;
    std::set<double> own;
    for (const ParamSpec* s : stepped) own.insert(*s->step.number);
    if (own.size() < 2) continue;
    for (ParamSpec* s : stepped) s->step.number = last;
    out.read_notes.push_back(fmt::format("DeepSpeed's FusedAdam counts param group {}'s steps on its last param only "
                                         "(its params held {}): all {} read at step {}", group_base + g,
                                         fmt::join(own, ", "), stepped.size(), static_cast<int64_t>(last)));
  }
  return Status::Ok();
}

// The optimizer dict's keys beside 'state' and 'param_groups'. nanotron's NamedOptimizer adds
// 'names' ({id: fqn} for the ids with state) and its OptimizerFromGradientAccumulator
// 'gradient_accumulator' ({fqn: the fp32 weights the optimizer steps}, taken as the model dict:
// `model`, `model_key`); any other key is named as not read.
Status read_optimizer_extras(const Pickle& p, Ref opt, const std::string& ow, StateDict& out, OptimizerPart& part,
                             Ref& model, std::string& model_key) {
  const auto& items = *dict_items(p, opt);
  for (size_t k = 0; k + 1 < items.size(); k += 2) {
    const auto key = dcp::as_string(p, items[k]);
    const Ref v = items[k + 1];
    if (key && (*key == "state" || *key == "param_groups")) continue;
    if (key && *key == "names") {
      const auto* names = dict_items(p, v);
      if (!names) return corrupt(ow + ": 'names' is not a dict");
      if (part.keyed_by_name) return corrupt(ow + ": 'names' beside params listed by name");
      std::set<std::string> seen;
      for (size_t j = 0; j + 1 < names->size(); j += 2) {
        const auto& id = p.at((*names)[j]);
        const auto name = dcp::as_string(p, (*names)[j + 1]);
        if (id.kind != Kind::kInt) return corrupt(ow + ": a 'names' key is not a param id");
        const auto member = part.members.find(id.i);
        if (member == part.members.end())
          return corrupt(fmt::format("{}: 'names' names param id {}, which no param group lists", ow, id.i));
        if (!name || name->empty()) return corrupt(fmt::format("{}: 'names' of param id {} is not a name", ow, id.i));
        if (!seen.insert(*name).second) return corrupt(fmt::format("{}: 'names' gives '{}' twice", ow, *name));
        std::string& current = member->second.second;
        if (part.named_in_groups && current != *name)
          return corrupt(fmt::format("{}: 'names' names param id {} '{}', its group's param_names '{}'", ow, id.i, *name,
                                     current));
        current = *name;
        if (auto it = part.params.find(id.i); it != part.params.end()) it->second.fqn = *name;
      }
      part.named_in_groups = true;  // a model dict beside them is looked up by name
      out.nanotron = true;
      continue;
    }
    if (key && *key == "gradient_accumulator" && dict_items(p, v)) {
      if (model != kNoRef)
        return corrupt(fmt::format("{}: 'gradient_accumulator' (nanotron's fp32 weights) beside the model dict {}", ow,
                                   model_key));
      model = v;
      model_key = out.optimizer_path + "['gradient_accumulator']";
      out.nanotron = true;
      continue;
    }
    out.not_read.push_back(fmt::format("the optimizer dict's '{}'", key ? *key : "?"));
  }
  return Status::Ok();
}

// Composer's DecoupledAdamW's groups, each decay read as AdamW's (dcp::adamw_decay_of_decoupled).
Status read_decoupled_decay(std::vector<GroupSpec>& groups, const std::string& where, std::vector<std::string>& notes) {
  for (size_t g = 0; g < groups.size(); ++g) {
    double& wd = groups[g].hyper.weight_decay;
    std::optional<double> initial;
    for (const GroupExtraSpec& e : groups[g].extras)
      if (e.key == "initial_lr" && (e.value.kind == GroupValue::Kind::kFloat || e.value.kind == GroupValue::Kind::kInt))
        initial = e.value.kind == GroupValue::Kind::kFloat ? e.value.f : static_cast<double>(e.value.i);
    OPTSTATE_ASSIGN_OR_RETURN(wd, dcp::adamw_decay_of_decoupled(wd, initial, g, fmt::format("{} param group {}", where, g),
                                                                notes));
  }
  return Status::Ok();
}

}  // namespace

std::optional<StateDict::MegatronArgs> megatron_args_of(const Pickle& p) {
  const Ref root = p.root();
  const Ref args = p.dict_get(root, "args");
  if (args == kNoRef || p.dict_get(root, "checkpoint_version") == kNoRef || p.at(args).kind != Kind::kObject ||
      !dict_items(p, p.at(args).state))
    return std::nullopt;
  const Ref st = p.at(args).state;
  auto int_of = [&](const char* k) -> std::optional<int64_t> {
    const Ref v = p.dict_get(st, k);
    if (v == kNoRef || p.at(v).kind != Kind::kInt) return std::nullopt;
    return p.at(v).i;
  };
  StateDict::MegatronArgs ma{int_of("tensor_model_parallel_size"), int_of("pipeline_model_parallel_size"),
                             int_of("expert_model_parallel_size"), int_of("expert_tensor_parallel_size"),
                             int_of("num_experts"), int_of("virtual_pipeline_model_parallel_size"), std::nullopt};
  if (const Ref d = p.dict_get(st, "use_distributed_optimizer"); d != kNoRef && p.at(d).kind == Kind::kBool)
    ma.distributed_optimizer = p.at(d).i != 0;
  return ma;
}

namespace {

// The optimizer state_dict at `opt` read into `out` (its groups appended, numbered from 0: `out`
// holds no other optimizer's), its numbered params named by the model dict at `model` where that
// holds their weights. A mixed-precision optimizer's wrapper (Megatron's; DeepSpeed's without
// ZeRO): its fp32 main params at `megatron_main`, a list per group (`megatron_at` names the wrapper
// dict, `main_key` the list's key there). `experts`: one optimizer of Megatron's chain, which takes
// only the model's experts' tensors (true) or only the others (false).
Status read_optimizer_state(const Pickle& p, const std::string& where, StateDict& out, Ref opt, ModelSource models,
                            Ref megatron_main, const std::string& megatron_at, std::optional<bool> experts,
                            std::string_view main_key = "fp32_from_fp16_params") {
  const std::string ow = where + (out.optimizer_path.empty() ? "" : " " + out.optimizer_path);

  OptimizerPart part;
  if (!out.per_param) {
    OPTSTATE_RETURN_IF_ERROR(interpret_optimizer(p, opt, ow, out, part));
    if (out.decoupled_decay) OPTSTATE_RETURN_IF_ERROR(read_decoupled_decay(out.groups, ow, out.read_notes));
    Ref model = models.empty() ? kNoRef : models.parts[0].dict;
    std::string model_key = models.empty() ? std::string() : models.parts[0].key;
    OPTSTATE_RETURN_IF_ERROR(read_optimizer_extras(p, opt, ow, out, part, model, model_key));
    if (model != (models.empty() ? kNoRef : models.parts[0].dict))  // nanotron's gradient_accumulator
      models.parts = {{model, model_key, ""}};
  } else {
    // One optimizer per param: each one's group is a group of the state, its one param named by
    // its key and numbered in the dict's order (as the wrapper lists model.named_parameters()).
    const auto& items = *dict_items(p, opt);
    std::set<std::string> fqns;
    for (size_t k = 0; k + 1 < items.size(); k += 2) {
      const std::string fqn = *dcp::as_string(p, items[k]);
      const std::string sw = fmt::format("{}['{}']", ow, fqn);
      if (fqn.empty()) return corrupt(sw + ": an empty param name");
      const int gbase = static_cast<int>(out.groups.size());
      OptimizerPart one;
      OPTSTATE_RETURN_IF_ERROR(interpret_optimizer(p, items[k + 1], sw, out, one, out.groups.size(), fqn));
      const int64_t id = static_cast<int64_t>(part.members.size());
      if (one.members.size() != 1 || out.groups.size() != static_cast<size_t>(gbase) + 1)
        return internal_error(sw + ": not one param in one group");
      if (!fqns.insert(fqn).second) return corrupt(fmt::format("{}: param '{}' is listed twice", ow, fqn));
      part.members.emplace(id, std::pair{gbase, fqn});
      part.group_ids.push_back({id});
      if (!one.params.empty()) {
        ParamSpec spec = std::move(one.params.begin()->second);
        spec.id = id;
        spec.fqn = fqn;
        spec.group = gbase;
        part.params.emplace(id, std::move(spec));
      }
      part.torchao_groups = part.torchao_groups && one.torchao_groups;
    }
    part.named_in_groups = true;  // named by their keys: a model beside them is looked up by name
  }
  auto& [members, params, group_ids, keyed_by_name, named_in_groups, torchao_groups] = part;
  out.model_ref = models.empty() ? kNoRef : models.parts[0].dict;
  const std::string model_key = models.key();

  // Weights beside the optimizer, by name; every other tensor there is named as not read. A param
  // the optimizer never stepped has no state, but its weights give it a shape: it is carried with
  // no moments and step 0, as the DCP reader carries it.
  std::set<std::string> weights_read;
  if (out.deepspeed_flat) out.model_key = model_key;  // its tensors placed by the format (deepspeed_flat.h)
  if (!models.empty() && !out.deepspeed_flat) {
    std::map<std::string, Ref, std::less<>> weights;  // by name, indexed once: a model has thousands
    // ... and by torch's fqn of the name: a param named 'wte.weight' (param_names as this driver
    // writes them) has its weights under a compiled model's key '_orig_mod.wte.weight'.
    std::map<std::string, const std::string*, std::less<>> key_of_fqn;
    std::map<std::string, const ModelSource::Part*, std::less<>> part_of;  // (a name's dict)
    size_t entries = 0;
    for (const ModelSource::Part& mpart : models.parts) {
      const auto& mitems = *dict_items(p, mpart.dict);
      entries += mitems.size() / 2;
      for (size_t k = 0; k + 1 < mitems.size(); k += 2)
        if (const auto name = dcp::as_string(p, mitems[k])) {
          weights.emplace(mpart.prefix + *name, mitems[k + 1]);
          part_of.emplace(mpart.prefix + *name, &mpart);
        }
    }
    std::vector<std::string_view> keys;
    for (const auto& [name, ref] : weights) keys.push_back(name);
    out.ddp_prefix = is_ddp_state_dict(keys);  // ddp.state_dict() saved: 'module.' on every key
    for (const auto& [name, ref] : weights) key_of_fqn.emplace(torch_param_fqn(name, out.ddp_prefix), &name);
    auto weight_of = [&](const std::string& name) {
      auto it = weights.find(name);
      if (it != weights.end()) return it;
      const auto k = key_of_fqn.find(name);
      return k == key_of_fqn.end() ? weights.end() : weights.find(*k->second);
    };
    // Numbered params whose numbers the model does not name: named after the model's tensors.
    bool by_number = !keyed_by_name && !named_in_groups && !members.empty();
    for (const auto& [id, member] : members) by_number = by_number && !weights.count(member.second);
    if (by_number) {
      std::map<int64_t, std::vector<int64_t>> shape_of;
      for (const auto& [id, spec] : params) shape_of.emplace(id, spec.shape);
      auto md = interpret_model_source(p, models, where);
      if (md.ok() && experts) {  // one optimizer of Megatron's chain: its experts' tensors, or the rest
        ModelDict taken;
        for (const ModelTensor& t : md->tensors)
          if (megatron::is_expert_param(t.name) == *experts) {
            taken.by_name.emplace(t.name, taken.tensors.size());
            taken.tensors.push_back(t);
          }
        *md = std::move(taken);
      }
      const ModelNames names = md.ok() ? names_from_model(*md, group_ids, shape_of) : ModelNames{{}, md.status().message()};
      if (!names.why.empty()) {
        out.not_read.push_back(fmt::format("{} (the model's tensors: {}, so params keep their numbers)", model_key, names.why));
      } else {
        for (const auto& [id, name] : names.by_id) {
          members[id].second = name;
          if (auto it = params.find(id); it != params.end()) it->second.fqn = name;
        }
      }
    }
    for (const auto& [id, member] : members)
      if (!params.count(id) && weight_of(member.second) != weights.end()) {
        ParamSpec spec;
        spec.fqn = member.second;
        spec.id = id;
        spec.group = member.first;
        spec.step.number = 0;
        params.emplace(id, std::move(spec));
      }
    for (auto& [id, spec] : params) {
      const auto found = weight_of(spec.fqn);
      if (found == weights.end()) continue;
      const Ref w = found->second;
      const ModelSource::Part& in = *part_of.at(found->first);
      const std::string ww = fmt::format("{} {}['{}']", where, in.key, found->first.substr(in.prefix.size()));
      OPTSTATE_ASSIGN_OR_RETURN(LocalValue lv, local_value(p, w, ww));
      const Payload& pl = lv.local;
      if (pl.kind != Payload::Kind::kTensor) return corrupt(ww + ": not a tensor");
      const auto& wshape = lv.dtensor ? lv.dtensor->global_shape : pl.tensor.shape;
      if (spec.entries.empty()) spec.shape = wshape;
      if (wshape != spec.shape)
        return corrupt(fmt::format("{}: shape {}, its optimizer state's is {}", ww, format_shape(wshape),
                                   format_shape(spec.shape)));
      if (pl.tensor.dtype != DType::kF32 && pl.tensor.dtype != DType::kBF16 && pl.tensor.dtype != DType::kF16)
        return corrupt(fmt::format("{}: a {} weight; optstate carries fp32, bf16 or fp16 weights", ww,
                                   dtype_name(pl.tensor.dtype)));
      spec.weight = pl.tensor;
      spec.weight_dtensor = lv.dtensor;
      weights_read.insert(found->first);
    }
    const size_t others = entries - weights_read.size();
    out.model_key = model_key;
    out.model_weight_keys = weights_read;
    out.model_others = others;
    if (others) {
      out.model_others_line = out.not_read.size();
      out.not_read.push_back(model_others_text(model_key, others));
    }
  }

  // The wrapper's fp32 main params: the weights it steps, group by group in its members' order (the
  // model dict's are their bf16/fp16 copies).
  if (megatron_main != kNoRef) {
    const std::string mw = fmt::format("{} {}", where, megatron_at);
    const auto& main_groups = *list_items(p, megatron_main);
    if (main_groups.size() != group_ids.size())
      return corrupt(fmt::format("{}['{}']: {} groups, the optimizer has {}", mw, main_key, main_groups.size(),
                                 group_ids.size()));
    for (size_t g = 0; g < group_ids.size(); ++g) {
      const auto* mains = list_items(p, main_groups[g]);
      const std::string gw = fmt::format("{}['{}'][{}]", mw, main_key, g);
      if (!mains || mains->size() != group_ids[g].size())
        return corrupt(fmt::format("{}: not a list of the group's {} params", gw, group_ids[g].size()));
      for (size_t i = 0; i < mains->size(); ++i) {
        const auto it = params.find(group_ids[g][i]);
        if (it == params.end()) continue;  // never stepped: its weights, if any, are the model's
        const std::string tw = fmt::format("{}[{}] (param '{}')", gw, i, it->second.fqn);
        OPTSTATE_ASSIGN_OR_RETURN(LocalValue lv, local_value(p, (*mains)[i], tw));
        if (lv.local.kind != Payload::Kind::kTensor || lv.dtensor) return corrupt(tw + ": not a tensor");
        if (lv.local.tensor.dtype != DType::kF32) return corrupt(fmt::format("{}: {}, not float32", tw, dtype_name(lv.local.tensor.dtype)));
        if (lv.local.tensor.shape != it->second.shape)
          return corrupt(fmt::format("{}: shape {}, its optimizer state's is {}", tw, format_shape(lv.local.tensor.shape),
                                     format_shape(it->second.shape)));
        it->second.weight = lv.local.tensor;
        it->second.weight_dtensor.reset();
      }
    }
    out.read_notes.push_back(fmt::format("{}'s fp32 main params ({}['{}']) read as the params' weights; the model "
                                         "dict's {} copies name them", out.deepspeed_fp16 ? "DeepSpeed" : "Megatron",
                                         megatron_at, main_key, !models.empty() ? "bf16/fp16" : "(absent)"));
  }

  out.torchao = out.torchao || (torchao_groups && !out.bnb);
  for (auto& [id, spec] : params) out.groups[static_cast<size_t>(spec.group)].params.push_back(spec.fqn);
  out.members = members.size();
  out.stateless = members.size() - params.size();
  out.member_ids = std::move(group_ids);
  // Each group keeps its members in its own order (params were visited by id; torch numbers them
  // in group order, so the two agree for files torch wrote).
  for (auto& [id, spec] : params) out.params.push_back(std::move(spec));
  return Status::Ok();
}

}  // namespace

namespace {

// One optimizer of Megatron's chain in its trainer dict's ['optimizer'] list: its state_dict (`opt`)
// and, under mixed precision, its fp32 main params (`main`) in its wrapper dict (`at`).
struct ChainPart {
  Ref opt = kNoRef, main = kNoRef;
  std::string at;
};

// Megatron's chain of optimizers (ChainedOptimizer under a mixture of experts: the dense params'
// optimizer, then the experts', each a state_dict of its own with params numbered from 0): each
// read alone, naming its params among the model's experts' tensors or among the others as its
// groups' is_expert_parallel says, then put together as one state: groups one after another,
// params numbered on.
Result<StateDict> merge_megatron_chain(const Pickle& p, const std::string& where, StateDict out,
                                       const std::vector<ChainPart>& chain, const ModelSource& models) {
  std::set<std::string> weights_read, unread;
  std::set<bool> kinds;
  int64_t next_id = 0;
  for (size_t i = 0; i < chain.size(); ++i) {
    StateDict sub;
    sub.optimizer_path = chain[i].main != kNoRef ? chain[i].at + "['optimizer']" : chain[i].at;
    const std::string ow = where + " " + sub.optimizer_path;
    const auto* groups = list_items(p, p.dict_get(chain[i].opt, "param_groups"));
    if (!groups || groups->empty()) return corrupt(ow + ": 'param_groups' is not a non-empty list");
    std::optional<bool> experts;
    for (size_t g = 0; g < groups->size(); ++g) {
      const Ref e = p.dict_get((*groups)[g], "is_expert_parallel");
      const bool v = e != kNoRef && dcp::as_bool(p, e).value_or(false);
      if (experts && *experts != v)
        return corrupt(fmt::format("{}: param groups of the experts (is_expert_parallel) beside groups of dense params; "
                                   "Megatron's chain gives each its own optimizer", ow));
      experts = v;
    }
    if (!kinds.insert(*experts).second)
      return unsupported(fmt::format("{}: a second optimizer of {} in Megatron's chain; optstate reads a chain of the "
                                     "dense params' optimizer and the experts'", ow,
                                     *experts ? "experts' params" : "dense params"));
    OPTSTATE_RETURN_IF_ERROR(
        read_optimizer_state(p, where, sub, chain[i].opt, models, chain[i].main, chain[i].at, experts));
    if (sub.eight || sub.bnb || sub.torchao || sub.per_param || sub.nanotron || sub.libtorch)
      return corrupt(ow + ": not torch's AdamW state_dict, which Megatron's optimizers hold");
    const int base_group = static_cast<int>(out.groups.size());
    int64_t top = next_id;
    for (const auto& ids : sub.member_ids) {
      auto& shifted = out.member_ids.emplace_back();
      for (int64_t id : ids) {
        shifted.push_back(id + next_id);
        top = std::max(top, id + next_id + 1);
      }
    }
    for (ParamSpec& spec : sub.params) {
      spec.id += next_id;
      spec.group += base_group;
      out.params.push_back(std::move(spec));
    }
    next_id = top;
    for (GroupSpec& g : sub.groups) out.groups.push_back(std::move(g));
    out.members += sub.members;
    out.stateless += sub.stateless;
    for (size_t n = 0; n < sub.not_read.size(); ++n)
      if (n != sub.model_others_line && unread.insert(sub.not_read[n]).second) out.not_read.push_back(sub.not_read[n]);
    for (std::string& n : sub.read_notes)
      if (std::find(out.read_notes.begin(), out.read_notes.end(), n) == out.read_notes.end())
        out.read_notes.push_back(std::move(n));
    weights_read.insert(sub.model_weight_keys.begin(), sub.model_weight_keys.end());
  }
  out.megatron = true;  // a write carrying the file would keep the chain as it was: not carried
  out.model_ref = models.empty() ? kNoRef : models.parts[0].dict;
  if (!models.empty()) {
    out.model_key = models.key();
    out.model_weight_keys = weights_read;
    size_t entries = 0;
    for (const ModelSource::Part& part : models.parts) entries += dict_items(p, part.dict)->size() / 2;
    out.model_others = entries - weights_read.size();
    if (out.model_others) {
      out.model_others_line = out.not_read.size();
      out.not_read.push_back(model_others_text(out.model_key, out.model_others));
    }
  }
  out.read_notes.push_back(fmt::format("Megatron's chain of {} optimizers ({}: the dense params' and the MoE "
                                       "experts') read as one state, their param groups one after another",
                                       chain.size(), out.optimizer_path));
  return out;
}

}  // namespace

namespace {

// A mixed-precision optimizer's wrapper dict at `wrapper` (`at` names it): its keys other than the
// optimizer's (`opt_key`) and the main params' (`main_key`) named as not read.
void name_wrapper_rest(const Pickle& p, Ref wrapper, const std::string& at, std::string_view opt_key,
                       std::string_view main_key, std::vector<std::string>& not_read) {
  const auto& items = *dict_items(p, wrapper);
  for (size_t j = 0; j + 1 < items.size(); j += 2) {
    const auto key = dcp::as_string(p, items[j]);
    if (!key || (*key != opt_key && *key != main_key)) not_read.push_back(fmt::format("{}['{}']", at, key ? *key : "?"));
  }
}

}  // namespace

Result<StateDict> interpret_state_dict(const Pickle& p, const std::string& where) {
  StateDict out;
  const Ref root = p.root();
  if (is_script_module(p, root)) return interpret_libtorch_archive(p, where);
  Ref opt = kNoRef, model = kNoRef;
  Ref megatron_main = kNoRef;  // Megatron's fp32_from_fp16_params, if any ...
  std::string megatron_at;     // ... and where its wrapper dict is
  std::string main_key = "fp32_from_fp16_params";  // ... and the main params' key there
  std::string model_key;  // where the model's state_dict is: "['model']", ...
  std::vector<ChainPart> chain;  // Megatron's chain of optimizers, if ['optimizer'] is one
  if (is_optimizer_dict(p, root)) {
    opt = root;
  } else if (is_per_param_dict(p, root, 2)) {
    opt = root;  // {"w": sd} alone is more likely {"optimizer": sd} of a one-param model: not this
    out.per_param = true;
  } else if (const auto* items = dict_items(p, root)) {
    std::vector<std::string> found;
    // Composer's (MosaicML's) checkpoint: {"state": {"model": ..., "optimizers": {<its class name>:
    // state_dict}, "schedulers", "timestamp", ...}, "rng": ...}. Its entries are looked at one
    // level down, under "['state']".
    const Ref composer = p.dict_get(root, "state");
    const bool is_composer = dict_items(p, composer) && dict_items(p, p.dict_get(composer, "optimizers")) &&
                             dict_items(p, p.dict_get(composer, "model"));
    if (is_composer) {
      for (size_t k = 0; k + 1 < items->size(); k += 2) {
        const auto key = dcp::as_string(p, (*items)[k]);
        if (!key || *key != "state") out.not_read.push_back(key ? fmt::format("['{}']", *key) : "[?]");
      }
      items = dict_items(p, composer);
    }
    // Megatron-LM's trainer dict: its args' parallel sizes, which the rank folders must agree with
    if (!is_composer) out.megatron_args = megatron_args_of(p);
    // DeepSpeed's model states file (mp_rank_00_model_states.pt) without ZeRO: the model under
    // ['module'] beside ['ds_version'], the optimizer under ['optimizer'] (torch's state_dict, or
    // its mixed-precision wrapper's dict).
    // ... or an expert-parallel rank's optimizer file of DeepSpeed MoE without ZeRO
    // (expp_rank_E_mp_rank_00_optim_states.pt): {"optimizer": the same}, alone.
    const bool deepspeed = !is_composer && ((p.dict_get(root, "ds_version") != kNoRef &&
                                             dict_items(p, p.dict_get(root, "module"))) ||
                                            (items->size() == 2 && p.dict_get(root, "optimizer") != kNoRef));
    const std::string prefix = is_composer ? "['state']" : "";
    for (size_t k = 0; k + 1 < items->size(); k += 2) {
      const auto key = dcp::as_string(p, (*items)[k]);
      const Ref v = (*items)[k + 1];
      const std::string name = prefix + (key ? fmt::format("['{}']", *key) : "[?]");
      if (is_composer && key && *key == "optimizers") {
        // {class name: state_dict}, one per optimizer
        const auto& optimizers = *dict_items(p, v);
        for (size_t j = 0; j + 1 < optimizers.size(); j += 2) {
          const auto cls = dcp::as_string(p, optimizers[j]);
          const std::string at = fmt::format("{}['{}']", name, cls ? *cls : "?");
          if (!is_optimizer_dict(p, optimizers[j + 1])) return corrupt(fmt::format("{}: {} is no optimizer state_dict", where, at));
          found.push_back(at);
          opt = optimizers[j + 1];
          out.decoupled_decay = cls && *cls == "DecoupledAdamW";
        }
      } else if (is_composer && key && *key == "model") {
        model = v;
        model_key = name;
      } else if (is_optimizer_dict(p, v)) {
        found.push_back(name);
        opt = v;
      } else if (const Ref inner = p.dict_get(v, "optimizer_state_dict");
                 deepspeed && key && *key == "optimizer" && dict_items(p, v) && is_optimizer_dict(p, inner)) {
        // DeepSpeed's mixed-precision optimizer without ZeRO (bf16 or fp16: FP16_UnfusedOptimizer,
        // as for a client's torch optimizer): {"optimizer_state_dict": torch's state_dict,
        // "fp32_groups": per group, its params' fp32 master copies, "cur_scale", ...}. Its fused
        // form (FP16_Optimizer, around DeepSpeed's FusedAdam) keeps one flat master per group
        // ("fp32_groups_flat"), the inner optimizer's one param per group: the format places the
        // params in it (deepspeed/deepspeed_flat.h).
        const Ref flat = p.dict_get(v, "fp32_groups_flat");
        const bool fused = flat != kNoRef;
        if (fused == (p.dict_get(v, "fp32_groups") != kNoRef) || !list_items(p, fused ? flat : p.dict_get(v, "fp32_groups")))
          return corrupt(fmt::format("{} {}: DeepSpeed's mixed-precision optimizer holds neither a list 'fp32_groups' "
                                     "(FP16_UnfusedOptimizer) nor a list 'fp32_groups_flat' (FP16_Optimizer), or both",
                                     where, name));
        found.push_back(name + "['optimizer_state_dict']");
        opt = inner;
        megatron_at = name;
        if (fused) {
          const auto& masters = *list_items(p, flat);
          for (size_t g = 0; g < masters.size(); ++g) {
            const std::string mw = fmt::format("{} {}['fp32_groups_flat'][{}]", where, name, g);
            OPTSTATE_ASSIGN_OR_RETURN(LocalValue lv, local_value(p, masters[g], mw));
            if (lv.local.kind != Payload::Kind::kTensor || lv.dtensor) return corrupt(mw + ": not a tensor");
            if (lv.local.tensor.dtype != DType::kF32 || lv.local.tensor.shape.size() != 1)
              return corrupt(fmt::format("{}: a {} tensor of shape {}, not a flat float32 one", mw,
                                         dtype_name(lv.local.tensor.dtype), format_shape(lv.local.tensor.shape)));
            out.deepspeed_flat_masters.push_back(lv.local.tensor);
          }
          out.deepspeed_flat_at = name;
          out.deepspeed_flat = true;
        } else {
          megatron_main = p.dict_get(v, "fp32_groups");
          main_key = "fp32_groups";
        }
        name_wrapper_rest(p, v, name, "optimizer_state_dict", fused ? "fp32_groups_flat" : "fp32_groups", out.not_read);
        out.deepspeed_fp16 = true;
      } else if (deepspeed && key && *key == "module" && model == kNoRef) {
        model = v;
        model_key = name;
      } else if (const Ref inner = p.dict_get(v, "optimizer"); dict_items(p, v) && is_optimizer_dict(p, inner) &&
                 list_items(p, p.dict_get(v, "fp32_from_fp16_params"))) {
        // Megatron's mixed-precision optimizer (Float16OptimizerWithFloat16Params) in its legacy
        // checkpoint (model_optim_rng.pt): {"optimizer": torch's state_dict, "fp32_from_fp16_params":
        // per group, its params' fp32 main copies, "grad_scaler": ...}
        found.push_back(name + "['optimizer']");
        opt = inner;
        megatron_main = p.dict_get(v, "fp32_from_fp16_params");
        megatron_at = name;
        name_wrapper_rest(p, v, name, "optimizer", "fp32_from_fp16_params", out.not_read);
        out.megatron = true;
      } else if (const auto* list = list_items(p, v); list && key && *key == "optimizer" && out.megatron_args &&
                 !list->empty() && list->size() <= 16) {
        // Megatron's chain of optimizers (ChainedOptimizer.state_dict under a mixture of experts): a
        // list of its optimizers' state_dicts, each plain or mixed precision's wrapper
        for (size_t i = 0; i < list->size(); ++i) {
          const Ref item = (*list)[i];
          const std::string at = fmt::format("{}[{}]", name, i);
          const Ref inner = p.dict_get(item, "optimizer");
          if (is_optimizer_dict(p, item)) {
            chain.push_back({item, kNoRef, at});
          } else if (dict_items(p, item) && is_optimizer_dict(p, inner) &&
                     list_items(p, p.dict_get(item, "fp32_from_fp16_params"))) {
            chain.push_back({inner, p.dict_get(item, "fp32_from_fp16_params"), at});
            name_wrapper_rest(p, item, at, "optimizer", "fp32_from_fp16_params", out.not_read);
          } else {
            return corrupt(fmt::format("{} {}: neither an optimizer state_dict nor Megatron's mixed-precision "
                                       "optimizer's dict (Megatron's chain of optimizers holds one of either)", where, at));
          }
        }
        found.push_back(name);
        opt = v;
      } else if (is_per_param_dict(p, v, 1)) {
        found.push_back(name);  // torchtune's recipe_state.pt: {"optimizer": {fqn: sd}, "seed": ...}
        opt = v;
        out.per_param = true;
      } else if (const auto* list = list_items(p, v);
                 list && !list->empty() && list->size() <= 64 && is_optimizer_dict(p, (*list)[0])) {
        // Lightning's "optimizer_states": one per optimizer (a GAN's two are refused below, named)
        for (size_t i = 0; i < list->size(); ++i)
          if (is_optimizer_dict(p, (*list)[i])) {
            found.push_back(fmt::format("{}[{}]", name, i));
            opt = (*list)[i];
          }
      } else if (key && (*key == "model" || *key == "model_state_dict" || *key == "state_dict") && dict_items(p, v) &&
                 model == kNoRef) {
        model = v;  // "state_dict": Lightning's (the LightningModule's, beside "optimizer_states")
        model_key = name;
      } else {
        out.not_read.push_back(name);
      }
    }
    if (found.empty() && deepspeed) {
      // A ZeRO run's model states file keeps no optimizer (its partitions are in the
      // zero_pp_rank_* files beside it) but the params' shapes.
      const Ref shapes = p.dict_get(root, "param_shapes");
      if (shapes != kNoRef && p.at(shapes).kind != Kind::kNone)
        return corrupt(fmt::format("{}: DeepSpeed's model states of a ZeRO run (['optimizer'] is None, ['param_shapes'] "
                                   "set): its optimizer files (zero_pp_rank_*_optim_states.pt) are missing", where));
    }
    if (found.empty())
      return corrupt(fmt::format("{}: no optimizer state_dict in it (a dict with 'state' and 'param_groups', at the "
                                 "top or one level down)", where));
    if (found.size() > 1)
      return corrupt(fmt::format("{}: holds {} optimizer state_dicts ({}); optstate reads a file with one", where,
                                 found.size(), fmt::join(found, ", ")));
    out.optimizer_path = found[0];
  } else {
    return corrupt(fmt::format("{}: data.pkl is not a dict, so not an optimizer state_dict", where));
  }
  out.optimizer_ref = opt;
  ModelSource models;
  if (model != kNoRef) models.parts.push_back({model, model_key, ""});
  if (out.megatron_args && model == kNoRef) {  // Megatron's virtual pipeline: its model chunks
    OPTSTATE_ASSIGN_OR_RETURN(const auto chunks, megatron_model_chunks(p, where));
    if (chunks) {
      models = *chunks;
      out.megatron_chunks = models.parts.size();
      std::erase_if(out.not_read, [&](const std::string& n) {
        return std::any_of(models.parts.begin(), models.parts.end(), [&](const auto& part) { return part.key == n; });
      });
    }
  }
  if (chain.empty()) {
    OPTSTATE_RETURN_IF_ERROR(
        read_optimizer_state(p, where, out, opt, std::move(models), megatron_main, megatron_at, std::nullopt, main_key));
    return out;
  }
  return merge_megatron_chain(p, where, std::move(out), chain, models);
}

// ---- DeepSpeed ZeRO ----

namespace {

// An int stored plainly or as an enum member (ZeroStageEnum(2) pickles as a call with its value).
std::optional<int64_t> int_or_enum(const Pickle& p, Ref r) {
  if (r == kNoRef) return std::nullopt;
  if (p.at(r).kind == Kind::kInt) return p.at(r).i;
  if (p.at(r).kind == Kind::kObject && p.at(r).args != kNoRef) {
    const auto* a = list_items(p, p.at(r).args);
    if (a && a->size() == 1 && p.at((*a)[0]).kind == Kind::kInt) return p.at((*a)[0]).i;
  }
  return std::nullopt;
}

Result<TensorRef> flat_tensor(const Pickle& p, Ref r, const std::string& where) {
  OPTSTATE_ASSIGN_OR_RETURN(Payload v, dcp::interpret_value(p, r, where));
  if (v.kind != Payload::Kind::kTensor || v.tensor.shape.size() != 1)
    return corrupt(where + ": not a 1-D tensor (ZeRO keeps flat partitions)");
  if (v.tensor.dtype != DType::kF32) return corrupt(fmt::format("{}: {}, not float32", where, dtype_name(v.tensor.dtype)));
  return v.tensor;
}

}  // namespace

Result<ZeroRank> interpret_zero_optim(const Pickle& p, const std::string& where) {
  const Ref osd = p.dict_get(p.root(), "optimizer_state_dict");
  if (!dict_items(p, osd)) return corrupt(where + ": no 'optimizer_state_dict' dict (not a DeepSpeed ZeRO optimizer file)");
  ZeroRank out;
  std::vector<int64_t> group_counts;  // stages 1 and 2: partition_count by param group
  const auto stage = int_or_enum(p, p.dict_get(osd, "zero_stage"));
  Ref base = kNoRef, masters = kNoRef;
  if (stage && *stage == 3) {
    out.stage = 3;
    base = p.dict_get(osd, "optimizer_state_dict");
    masters = p.dict_get(osd, "fp32_flat_groups");
    const auto n = int_or_enum(p, p.dict_get(osd, "partition_count"));
    if (!n) return corrupt(where + ": 'partition_count' is not an int");
    out.partitions = *n;
  } else if (!stage || *stage == 1 || *stage == 2) {
    out.stage = stage ? static_cast<int>(*stage) : 1;  // BF16_Optimizer (stage 1) records none
    base = p.dict_get(osd, "base_optimizer_state");
    masters = p.dict_get(osd, "single_partition_of_fp32_groups");
    const auto* counts = list_items(p, p.dict_get(osd, "partition_count"));
    if (!counts || counts->empty()) return corrupt(where + ": 'partition_count' is not a list");
    for (Ref c : *counts) {
      const auto n = int_or_enum(p, c);
      if (!n || *n < 1 || *n > (int64_t{1} << 20))
        return corrupt(where + ": a 'partition_count' that is not a world size");
      group_counts.push_back(*n);
    }
    out.partitions = group_counts[0];  // the dense groups', checked with the groups below
  } else {
    return corrupt(fmt::format("{}: ZeRO stage {}", where, *stage));
  }
  if (out.partitions < 1 || out.partitions > (int64_t{1} << 20))
    return corrupt(fmt::format("{}: partition_count {} is not a world size", where, out.partitions));
  if (base != kNoRef && p.at(base).kind == Kind::kList && out.stage != 3)
    return invalid_argument(where + ": an elastic checkpoint (\"elastic_checkpoint\": true): the wrapped optimizer's "
                                    "state is kept per group without its param_groups, so lr, betas, eps and weight "
                                    "decay are not in the files; save without it to read the state");
  if (!is_optimizer_dict(p, base))
    return corrupt(where + ": the wrapped optimizer's state_dict ('state', 'param_groups') is missing");
  const auto* groups = list_items(p, p.dict_get(base, "param_groups"));
  const auto* flat = list_items(p, masters);
  if (!groups || groups->empty() || !flat || flat->size() < groups->size())
    return corrupt(where + ": param groups and fp32 partitions do not pair up");
  out.param_groups = groups->size();
  if (out.stage != 3 && group_counts.size() != groups->size())
    return corrupt(fmt::format("{}: 'partition_count' lists {} param groups, the optimizer {}", where,
                               group_counts.size(), groups->size()));
  // MoE groups (DeepSpeed's split_params_into_different_moe_groups_for_optimizer: 'moe' true, named
  // "ep_size_E") are split over the expert-data-parallel group, W/E ranks; dense groups over all W.
  std::vector<std::optional<int64_t>> group_ep(groups->size());
  for (size_t g = 0; g < groups->size(); ++g) {
    const Ref moe = p.dict_get((*groups)[g], "moe");
    if (moe == kNoRef || !dcp::as_bool(p, moe).value_or(false)) continue;
    const std::string gw = fmt::format("{} param group {}", where, g);
    if (out.stage == 3)
      return corrupt(gw + ": a mixture of experts' group ('moe') under ZeRO stage 3, which DeepSpeed's MoE does not "
                          "run on");
    const auto name = dcp::as_string(p, p.dict_get((*groups)[g], "name"));
    const int64_t ep = name ? moe_group_ep_size(*name).value_or(0) : 0;
    if (ep < 1)
      return corrupt(fmt::format("{}: a mixture of experts' group ('moe') named {}, not ep_size_<expert-parallel "
                                 "size>", gw, name ? "'" + *name + "'" : "nothing"));
    group_ep[g] = ep;
  }
  if (out.stage != 3) {
    std::optional<int64_t> world;  // the dense groups' count; else an MoE group's count times its size
    for (size_t g = 0; g < groups->size(); ++g)
      if (!group_ep[g]) world = group_counts[g];
    if (!world) world = group_counts[0] * *group_ep[0];
    for (size_t g = 0; g < groups->size(); ++g) {
      const int64_t want = group_ep[g] ? *world / *group_ep[g] : *world;
      if (group_counts[g] != want || (group_ep[g] && *world % *group_ep[g] != 0))
        return corrupt(group_ep[g]
                           ? fmt::format("{} param group {}: partition_count {} for experts of expert-parallel size {} "
                                         "(ep_size_{}) in a world of {} ranks (expected {})", where, g, group_counts[g],
                                         *group_ep[g], *group_ep[g], *world, want)
                           : fmt::format("{}: 'partition_count' differs between param groups (not one data-parallel "
                                         "world): {} and {}", where, group_counts[g], *world));
    }
    out.partitions = *world;
  }
  const Ref state = p.dict_get(base, "state");
  const auto* sitems = dict_items(p, state);
  if (!sitems) return corrupt(where + ": 'state' is not a dict");
  const Refs* mappings = nullptr;
  if (out.stage != 3) {
    mappings = list_items(p, p.dict_get(osd, "param_slice_mappings"));
    if (!mappings || mappings->size() != groups->size())
      return corrupt(where + ": no 'param_slice_mappings' for every param group (DeepSpeed >= 0.7 records where "
                             "each param's run lies)");
  }
  std::set<std::string> other_keys;
  size_t next = 0;  // the flat params are numbered in group order
  for (size_t g = 0; g < groups->size(); ++g) {
    const std::string pgw = fmt::format("{} param group {}", where, g);
    const Ref gr = (*groups)[g];
    OPTSTATE_ASSIGN_OR_RETURN(const GroupSpec spec, adamw_group(p, gr, pgw));
    const auto* ids = list_items(p, p.dict_get(gr, "params"));
    if (!ids || ids->empty() || (out.stage != 3 && ids->size() != 1))
      return corrupt(pgw + (out.stage == 3 ? ": 'params' lists no flat param" : ": 'params' is not one flat param"));
    for (const Ref id_ref : *ids) {
      if (p.at(id_ref).kind != Kind::kInt || p.at(id_ref).i != static_cast<int64_t>(next) || next >= flat->size())
        return corrupt(fmt::format("{}: 'params' lists {} where flat param {} of {} is due", pgw,
                                   p.at(id_ref).kind == Kind::kInt ? std::to_string(p.at(id_ref).i) : "no number", next,
                                   flat->size()));
      const size_t fi = next++;
      const std::string gw = ids->size() == 1 ? pgw : fmt::format("{} flat param {}", pgw, fi);
      ZeroGroup zg;
      zg.param_group = g;
      zg.group = spec;
      zg.ep_size = group_ep[g];
      zg.partitions = out.stage == 3 ? out.partitions : group_counts[g];
      const auto id = static_cast<int64_t>(fi);
      Ref st = kNoRef;
      for (size_t k = 0; k + 1 < sitems->size(); k += 2)
        if (p.at((*sitems)[k]).kind == Kind::kInt && p.at((*sitems)[k]).i == id) st = (*sitems)[k + 1];
      const auto* fields = dict_items(p, st);
      // No state: the optimizer never stepped (under fp16, every step so far may have overflowed
      // and been skipped). All flat params step together, so either all have state or none has.
      if (!fields) {
        if (st != kNoRef) return corrupt(fmt::format("{}: the state of flat param {} is not a dict", gw, id));
        zg.step.number = 0;
      }
      ParamFields pf;  // bitsandbytes' nested quant state spliced in
      if (fields) {
        OPTSTATE_ASSIGN_OR_RETURN(pf, param_fields(p, *fields, gw));
      }
      for (const auto& [name, v] : pf.fields) {
        const std::string ew = fmt::format("{} '{}'", gw, name);
        if (name == "step") {
          OPTSTATE_ASSIGN_OR_RETURN(zg.step, scalar(p, v, ew));
        } else if (is_moment(name)) {
          OPTSTATE_ASSIGN_OR_RETURN(TensorRef t, flat_tensor(p, v, ew));
          if (!zg.moments.emplace(name, t).second) return corrupt(ew + ": listed twice");
        } else if (const auto moment = bnb_moment(name)) {
          // bitsandbytes' AdamW8bit (or 32-bit state) as ZeRO's wrapped optimizer: state1 is
          // exp_avg, state2 exp_avg_sq, of the flat partition.
          OPTSTATE_ASSIGN_OR_RETURN(const EntrySpec e, bnb_entry(p, pf, name, ew));
          const bool eight = e.encoding == Encoding::kBlockwise8;
          const TensorRef& t = eight ? e.codes : e.values;
          if (t.shape.size() != 1) return corrupt(ew + ": not a 1-D tensor (ZeRO keeps flat partitions)");
          if (!eight && t.dtype != DType::kF32) return corrupt(fmt::format("{}: {}, not float32", ew, dtype_name(t.dtype)));
          if (!zg.moments.emplace(*moment, t).second)
            return corrupt(fmt::format("{}: '{}' twice (as '{}' and bitsandbytes' '{}')", gw, *moment, *moment, name));
          if (eight) zg.quant[*moment] = ZeroQuant{e.absmax, *e.qmap, e.block_size};
          out.bnb = true;
        } else if (!bnb_part_of(name)) {  // absmax1, qmap1, ...: read with their state
          other_keys.insert(name);
        }
      }
      if (!zg.step.number && !zg.step.tensor) return corrupt(gw + ": no 'step'");
      if (fields && (!zg.moments.count(kExpAvg) || !zg.moments.count(kExpAvgSq)))
        return corrupt(gw + ": no 'exp_avg' and 'exp_avg_sq'");
      if (!out.groups.empty() && out.groups.front().moments.empty() != zg.moments.empty())
        return corrupt(fmt::format("{}: flat param {} has {}, flat param 0 {} (they step together)", gw, id,
                                   fields ? "state" : "no state (never stepped)", fields ? "none" : "has"));
      OPTSTATE_ASSIGN_OR_RETURN(zg.master, flat_tensor(p, (*flat)[fi], gw + " fp32 weights"));
      // The last rank's moments hold the group's padding too; its fp32 weights' partition does not.
      for (const auto& [name, t] : zg.moments)
        if (t.shape[0] < zg.master.shape[0])
          return corrupt(fmt::format("{} '{}': {} elements, fewer than the fp32 weights' partition's {}", gw, name,
                                     t.shape[0], zg.master.shape[0]));
      if (mappings) {
        const auto* items = dict_items(p, (*mappings)[fi]);
        if (!items) return corrupt(gw + ": 'param_slice_mappings' is not a dict");
        std::set<std::string> seen;
        for (size_t k = 0; k + 1 < items->size(); k += 2) {
          const auto name = dcp::as_string(p, (*items)[k]);
          const Ref fa = dcp::fields_of(p, (*items)[k + 1]);
          const auto numel = dcp::as_number(p, p.dict_get(fa, "numel")), start = dcp::as_number(p, p.dict_get(fa, "start"));
          if (!name || !numel || !start || *numel < 0 || *start < 0 || *numel > 9e15 || *start > 9e15 ||
              *numel != std::floor(*numel) || *start != std::floor(*start))
            return corrupt(gw + ": a param_slice_mappings entry is not a name with a fragment_address(numel, start)");
          if (!seen.insert(*name).second) return corrupt(fmt::format("{}: '{}' mapped twice", gw, *name));
          zg.fragments.push_back({*name, static_cast<int64_t>(*start), static_cast<int64_t>(*numel)});
        }
      }
      out.groups.push_back(std::move(zg));
    }
  }
  if (next != flat->size())
    return corrupt(fmt::format("{}: {} fp32 partitions, but the param groups list {} flat params", where, flat->size(), next));
  for (const std::string& k : other_keys) out.not_read.push_back(fmt::format("the optimizer's per-group '{}'", k));
  return out;
}

Result<UniversalOptimizer> interpret_universal_optimizer(const Pickle& p, const std::string& where) {
  const auto* groups = list_items(p, p.dict_get(p.root(), "param_groups"));
  if (!groups || groups->empty()) return corrupt(where + ": 'param_groups' is not a non-empty list");
  UniversalOptimizer out;
  const Ref nested = p.dict_get(p.root(), "optimizer_state_dict");
  // ZeRO-3's nested optimizer: its groups list the flat params (sub-groups), numbered in order.
  if (const auto* ngroups = nested == kNoRef ? nullptr : list_items(p, p.dict_get(nested, "param_groups"))) {
    if (ngroups->size() != groups->size())
      return corrupt(fmt::format("{}: {} param groups, {} in its optimizer_state_dict", where, groups->size(),
                                 ngroups->size()));
    for (size_t g = 0; g < ngroups->size(); ++g) {
      const auto* ids = list_items(p, p.dict_get((*ngroups)[g], "params"));
      if (!ids || ids->empty())
        return corrupt(fmt::format("{} optimizer_state_dict param group {}: 'params' lists no flat param", where, g));
      for (const Ref id : *ids) {
        if (p.at(id).kind != Kind::kInt || p.at(id).i != static_cast<int64_t>(out.group_of_flat.size()) ||
            out.group_of_flat.size() >= (size_t{1} << 24))
          return corrupt(fmt::format("{} optimizer_state_dict param group {}: 'params' are not the flat params "
                                     "numbered in order", where, g));
        out.group_of_flat.push_back(g);
      }
    }
  }
  const size_t flats = out.group_of_flat.empty() ? groups->size() : out.group_of_flat.size();
  if (const auto* st = nested == kNoRef ? nullptr : dict_items(p, p.dict_get(nested, "state")))
    for (size_t k = 0; k + 1 < st->size(); k += 2) {
      const pickle::Value& key = p.at((*st)[k]);
      const Ref step = p.dict_get((*st)[k + 1], "step");
      if (key.kind != Kind::kInt || key.i < 0 || static_cast<size_t>(key.i) >= flats || step == kNoRef) continue;
      OPTSTATE_ASSIGN_OR_RETURN(out.steps[static_cast<size_t>(key.i)],
                                scalar(p, step, fmt::format("{} optimizer_state_dict state {} 'step'", where, key.i)));
    }
  for (size_t g = 0; g < groups->size(); ++g) {
    const std::string gw = fmt::format("{} param group {}", where, g);
    if (!dict_items(p, (*groups)[g])) return corrupt(gw + ": not a dict");
    OPTSTATE_ASSIGN_OR_RETURN(GroupSpec spec, adamw_group(p, (*groups)[g], gw));
    if (spec.lr.tensor) return corrupt(gw + ": 'lr' is a tensor; DeepSpeed's groups hold a number");
    out.groups.push_back(std::move(spec));
  }
  return out;
}

Result<dcp::TensorRef> interpret_universal_tensor(const Pickle& p, const std::string& where) {
  Ref t = p.root();
  if (p.at(t).kind == Kind::kDict) t = p.dict_get(t, "param");
  if (t == kNoRef) return corrupt(where + ": neither a tensor nor a dict with 'param'");
  OPTSTATE_ASSIGN_OR_RETURN(const dcp::Payload v, dcp::interpret_value(p, t, where));
  if (v.kind != dcp::Payload::Kind::kTensor) return corrupt(where + ": 'param' is not a tensor");
  if (v.tensor.dtype != DType::kF32)
    return corrupt(fmt::format("{}: a {} tensor; DeepSpeed's universal state is float32", where, dtype_name(v.tensor.dtype)));
  return v.tensor;
}

Result<Scalar> interpret_universal_step(const Pickle& p, const std::string& where) {
  Ref t = p.root();
  if (p.at(t).kind == Kind::kDict) t = p.dict_get(t, "param");
  if (t == kNoRef) return corrupt(where + ": neither a step nor a dict with 'param'");
  return scalar(p, t, where);
}

std::optional<std::string> exact_name_of_pattern(std::string_view pattern) {
  if (pattern.size() < 2 || pattern.front() != '^' || pattern.back() != '$') return std::nullopt;
  pattern = pattern.substr(1, pattern.size() - 2);
  std::string name;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\') {
      if (++i == pattern.size()) return std::nullopt;  // the final $ was escaped
      const char e = pattern[i];
      // re.escape puts a backslash before each special character; an escaped letter or digit is a
      // class (\d, \w) or a backreference, not the character
      if (std::isalnum(static_cast<unsigned char>(e))) return std::nullopt;
      name.push_back(e);
      continue;
    }
    if (std::string_view(".^$*+?{}[]|()").find(c) != std::string_view::npos) return std::nullopt;
    name.push_back(c);
  }
  if (name.empty()) return std::nullopt;
  return name;
}

namespace {

// An affine map dict ({version, params: {key: {logical_shape, ranks}}}) whose keys are AutoTP's
// patterns (`patterns`) or AutoEP's param names.
Result<AutoTpMaps> affine_maps_of(const Pickle& p, Ref am, const std::string& mw, bool patterns) {
  AutoTpMaps out;
  const auto version = dcp::as_number(p, p.dict_get(am, "version"));
  if (!dict_items(p, am) || !version)
    return corrupt(mw + ": no affine map with a version");
  if (*version != 1)
    return corrupt(fmt::format("{}: affine_map version {}; optstate reads version 1", mw, *version));
  const auto* params = dict_items(p, p.dict_get(am, "params"));
  if (!params) return corrupt(mw + ": affine_map without a 'params' dict");
  if (params->size() / 2 > (size_t{1} << 16)) return corrupt(mw + ": more than 2^16 params in affine_map");
  auto dims = [&](Ref r, const std::string& what) -> Result<std::vector<int64_t>> {
    const auto v = dcp::as_int_list(p, r);
    if (!v || v->size() > 16) return corrupt(fmt::format("{}: {} is not a list of up to 16 ints", mw, what));
    return *v;
  };
  for (size_t k = 0; k + 1 < params->size(); k += 2) {
    const auto pattern = dcp::as_string(p, (*params)[k]);
    if (!pattern) return corrupt(mw + ": a key of affine_map.params is not a string");
    const auto name = patterns ? exact_name_of_pattern(*pattern) : pattern;
    if (!name)
      return corrupt(fmt::format("{}: affine_map pattern '{}' names no one param (DeepSpeed writes ^<name>$)", mw,
                                 *pattern));
    const std::string pw = fmt::format("{}: '{}'", mw, *name);
    const Ref entry = (*params)[k + 1];
    AffineMap m;
    OPTSTATE_ASSIGN_OR_RETURN(m.logical_shape, dims(p.dict_get(entry, "logical_shape"), "'" + *name + "' logical_shape"));
    OPTSTATE_RETURN_IF_ERROR(checked_numel(m.logical_shape).status().with_context(pw));
    const auto* ranks = dict_items(p, p.dict_get(entry, "ranks"));
    if (!ranks || ranks->empty() || ranks->size() / 2 > 4096) return corrupt(pw + ": 'ranks' is not a dict of 1 to 4096 ranks");
    for (size_t j = 0; j + 1 < ranks->size(); j += 2) {
      const Ref rank_ref = (*ranks)[j];
      if (p.at(rank_ref).kind != Kind::kInt || p.at(rank_ref).i < 0 || p.at(rank_ref).i >= 4096)
        return corrupt(pw + ": a rank of 'ranks' is not an int in [0, 4096)");
      const int64_t rank = p.at(rank_ref).i;
      const std::string rw = fmt::format("{} rank {}", pw, rank);
      AffineRank ar;
      OPTSTATE_ASSIGN_OR_RETURN(ar.shard_shape, dims(p.dict_get((*ranks)[j + 1], "shard_shape"), rw + " shard_shape"));
      OPTSTATE_RETURN_IF_ERROR(checked_numel(ar.shard_shape).status().with_context(rw));
      const auto* pieces = list_items(p, p.dict_get((*ranks)[j + 1], "pieces"));
      if (!pieces || pieces->size() > 4096) return corrupt(rw + ": 'pieces' is not a list of up to 4096");
      for (const Ref pr : *pieces) {
        AffinePiece pc;
        OPTSTATE_ASSIGN_OR_RETURN(pc.shape, dims(p.dict_get(pr, "shape"), rw + " piece shape"));
        for (const char* side : {"source", "dest"}) {
          const auto* sd = list_items(p, p.dict_get(pr, side));
          if (!sd || sd->size() != 2 || p.at((*sd)[0]).kind != Kind::kInt)
            return corrupt(fmt::format("{}: a piece's '{}' is not [offset, strides]", rw, side));
          OPTSTATE_ASSIGN_OR_RETURN(auto strides, dims((*sd)[1], fmt::format("{} piece {} strides", rw, side)));
          if (strides.size() != pc.shape.size())
            return corrupt(fmt::format("{}: a piece of {} axes with {} {} strides", rw, pc.shape.size(), strides.size(), side));
          (std::string_view(side) == "source" ? pc.source_offset : pc.dest_offset) = p.at((*sd)[0]).i;
          (std::string_view(side) == "source" ? pc.source_strides : pc.dest_strides) = std::move(strides);
        }
        OPTSTATE_ASSIGN_OR_RETURN(pc.locations, dims(p.dict_get(pr, "locations"), rw + " piece locations"));
        if (const Ref sc = p.dict_get(pr, "scale"); sc != kNoRef) {
          const auto v = dcp::as_number(p, sc);
          if (!v || !std::isfinite(*v) || *v == 0) return corrupt(rw + ": a piece's scale is no finite nonzero number");
          pc.scale = *v;
        }
        ar.pieces.push_back(std::move(pc));
      }
      if (!m.ranks.emplace(rank, std::move(ar)).second) return corrupt(fmt::format("{}: rank {} twice", pw, rank));
    }
    if (!out.params.emplace(*name, std::move(m)).second) return corrupt(fmt::format("{}: two maps", pw));
  }
  return out;
}

}  // namespace

Result<AutoTpMaps> interpret_autotp_maps(const Pickle& p, Ref info, const std::string& where) {
  const std::string mw = where + " universal_checkpoint_info";
  const Ref am = p.dict_get(info, "affine_map");
  if (!dict_items(p, am)) return corrupt(mw + ": no affine_map (the maps of DeepSpeed's AutoTP)");
  OPTSTATE_ASSIGN_OR_RETURN(AutoTpMaps out, affine_maps_of(p, am, mw, true));
  if (const auto* un = dict_items(p, p.dict_get(info, "autotp_unsupported_parameter_patterns")))
    for (size_t k = 0; k + 1 < un->size(); k += 2) {
      const auto pattern = dcp::as_string(p, (*un)[k]);
      const auto why = dcp::as_string(p, (*un)[k + 1]);
      const auto name = pattern ? exact_name_of_pattern(*pattern) : std::nullopt;
      out.unsupported[name ? *name : pattern.value_or("?")] = why.value_or("no reason given");
    }
  return out;
}

std::optional<int64_t> moe_group_ep_size(std::string_view name) {
  constexpr std::string_view head = "ep_size_";
  if (name.rfind(head, 0) != 0 || name.size() <= head.size() || name.size() > head.size() + 7 ||
      !std::all_of(name.begin() + head.size(), name.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return std::nullopt;
  return std::stoll(std::string(name.substr(head.size())));
}

Result<ZeroShapes> interpret_zero_model(const Pickle& p, const std::string& where) {
  const Ref shapes_ref = p.dict_get(p.root(), "param_shapes");
  ZeroShapes out;
  // DeepSpeed without ZeRO (stage 0) whose optimizer still saves bf16_zero_pp_rank_* files: a
  // pipeline's BF16_Optimizer. Its model states hold no param_shapes, and its state dict again
  // (data-parallel rank 0's); the caller finds the shapes elsewhere (the pipeline's layer files).
  out.without_zero = shapes_ref != kNoRef && p.at(shapes_ref).kind == Kind::kNone &&
                     dict_items(p, p.dict_get(p.root(), "optimizer"));
  const auto* groups = out.without_zero ? nullptr : list_items(p, shapes_ref);
  if (!out.without_zero && (!groups || groups->empty()))
    return corrupt(where + ": no 'param_shapes' list (not DeepSpeed's model states file)");
  if (out.without_zero)
    out.not_read.push_back("['optimizer'] (stage 0's optimizer state beside the model: data-parallel rank 0's, "
                           "as its optimizer file holds it)");
  std::set<std::string> names;
  for (size_t g = 0; groups && g < groups->size(); ++g) {
    const auto* items = dict_items(p, (*groups)[g]);
    if (!items) return corrupt(fmt::format("{}: param_shapes[{}] is not a dict", where, g));
    auto& params = out.groups.emplace_back();
    for (size_t k = 0; k + 1 < items->size(); k += 2) {
      const auto name = dcp::as_string(p, (*items)[k]);
      const auto shape = dcp::torch_size(p, (*items)[k + 1]);
      if (!name || !shape) return corrupt(fmt::format("{}: param_shapes[{}] has an entry that is no name and shape", where, g));
      OPTSTATE_RETURN_IF_ERROR(checked_numel(*shape).status().with_context(fmt::format("{}: '{}'", where, *name)));
      if (!names.insert(*name).second) return corrupt(fmt::format("{}: '{}' in param_shapes twice", where, *name));
      params.emplace_back(*name, *shape);
    }
  }
  if (const auto* frozen = dict_items(p, p.dict_get(p.root(), "frozen_param_shapes")); frozen && !frozen->empty())
    out.not_read.push_back(fmt::format("{} frozen param{} (no optimizer state)", frozen->size() / 2,
                                       frozen->size() == 2 ? "" : "s"));
  if (const auto* module = dict_items(p, p.dict_get(p.root(), "module")); module && !module->empty())
    out.not_read.push_back(fmt::format("['module'] ({} entries: the model's weights and buffers in their training "
                                       "dtype; the optimizer's fp32 weights are read)", module->size() / 2));
  for (const char* key : {"lr_scheduler", "data_sampler", "random_ltd"})
    if (const Ref r = p.dict_get(p.root(), key); r != kNoRef && p.at(r).kind != Kind::kNone)
      out.not_read.push_back(fmt::format("['{}']", key));
  auto count = [&](Ref r, const char* what) -> Result<std::optional<int64_t>> {
    if (r == kNoRef || p.at(r).kind == Kind::kNone) return std::optional<int64_t>{};
    const std::optional<int64_t> n = p.at(r).kind == Kind::kInt ? std::optional<int64_t>(p.at(r).i) : std::nullopt;
    if (!n || *n < 1 || *n > (int64_t{1} << 24)) return corrupt(fmt::format("{}: {} is not a count of ranks", where, what));
    return std::optional<int64_t>{*n};
  };
  OPTSTATE_ASSIGN_OR_RETURN(out.mp_world_size, count(p.dict_get(p.root(), "mp_world_size"), "mp_world_size"));
  if (const Ref uc = p.dict_get(p.root(), "universal_checkpoint_info"); dict_items(p, uc)) {
    out.uc_info = true;
    if (p.dict_get(uc, "affine_map") != kNoRef) {
      OPTSTATE_ASSIGN_OR_RETURN(out.autotp, interpret_autotp_maps(p, uc, where));
    }
  }
  if (const Ref dims = p.dict_get(p.root(), "checkpoint_parallel_dimensions"); dict_items(p, dims)) {
    OPTSTATE_ASSIGN_OR_RETURN(out.pp_degree, count(p.dict_get(dims, "pp_degree"), "pp_degree"));
    OPTSTATE_ASSIGN_OR_RETURN(out.tp_degree, count(p.dict_get(dims, "tp_degree"), "tp_degree"));
  }
  // DeepSpeed MoE: 'num_experts' lists each MoE layer's experts (saved by MoE models only).
  if (const Ref ne = p.dict_get(p.root(), "num_experts"); ne != kNoRef && p.at(ne).kind != Kind::kNone) {
    if (p.at(ne).kind == Kind::kInt)  // DeepSpeed's first MoE checkpoints: expert_<E>_mp_rank_* files, no layers
      return corrupt(where + ": 'num_experts' is one number: an MoE checkpoint of DeepSpeed before its per-layer "
                             "expert files (layer_<L>_expert_<E>_*), which is not read");
    const auto* items = list_items(p, ne);
    if (!items || items->size() > 4096) return corrupt(where + ": 'num_experts' is not a list of expert counts");
    for (const Ref r : *items) {
      if (p.at(r).kind != Kind::kInt || p.at(r).i < 1 || p.at(r).i > (int64_t{1} << 20))
        return corrupt(where + ": 'num_experts' is not a list of expert counts");
      out.num_experts.push_back(p.at(r).i);
    }
  }
  if (const Ref ae = p.dict_get(p.root(), "ds_autoep_layers"); ae != kNoRef && p.at(ae).kind != Kind::kNone) {
    const auto* layers = list_items(p, ae);
    if (!layers || layers->size() > 4096) return corrupt(where + ": 'ds_autoep_layers' is not a list of AutoEP layers");
    for (size_t l = 0; l < layers->size(); ++l) {
      const Ref lr = (*layers)[l];
      const std::string lw = fmt::format("{}: ds_autoep_layers[{}]", where, l);
      ZeroShapes::AutoEpLayer layer;
      const auto prefix = dcp::as_string(p, p.dict_get(lr, "expert_key_prefix"));
      const auto format = dcp::as_string(p, p.dict_get(lr, "checkpoint_format"));
      auto count = [&](const char* key) -> std::optional<int64_t> {
        const Ref r = p.dict_get(lr, key);
        if (r == kNoRef || p.at(r).kind != Kind::kInt || p.at(r).i < 1 || p.at(r).i > (int64_t{1} << 20)) return std::nullopt;
        return p.at(r).i;
      };
      const auto n = count("num_experts"), local = count("num_local_experts"), ep = count("ep_size");
      if (!prefix || !n || !local || !ep || *local * *ep != *n)
        return corrupt(lw + ": no expert_key_prefix, or num_experts, num_local_experts and ep_size that do not agree");
      if (format && *format != "per_expert_files")
        return corrupt(fmt::format("{}: checkpoint_format '{}' (AutoEP under ZeRO-3, its experts partitioned anew): "
                                   "not read; AutoEP under ZeRO-1/2 (per_expert_files) is", lw, *format));
      layer = {*prefix, *n, *local, *ep};
      OPTSTATE_ASSIGN_OR_RETURN(AutoTpMaps maps, affine_maps_of(p, p.dict_get(lr, "affine_maps"), lw + " affine_maps", false));
      for (auto& [name, m] : maps.params)
        if (!out.autoep_maps.params.emplace(name, std::move(m)).second)
          return corrupt(fmt::format("{}: '{}' mapped by two AutoEP layers", lw, name));
      out.autoep_layers.push_back(std::move(layer));
    }
  }
  const Ref config = p.dict_get(p.root(), "ds_config");
  if (dict_items(p, config))
    out.data_before_expert = dcp::as_bool(p, p.dict_get(config, "use_data_before_expert_parallelism")).value_or(false);
  const Ref opt = dict_items(p, config) ? p.dict_get(config, "optimizer") : kNoRef;
  if (dict_items(p, opt)) {
    const auto type = dcp::as_string(p, p.dict_get(opt, "type"));
    std::string lower = type ? *type : "";
    std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
    if (lower != "adam" && lower != "adamw")
      return corrupt(fmt::format("{}: ds_config's optimizer is {}, not Adam or AdamW: optstate reads AdamW state", where,
                                 type ? "'" + *type + "'" : std::string("of no type")));
    const Ref params = p.dict_get(opt, "params");
    const auto w_mode = dict_items(p, params) ? dcp::as_bool(p, p.dict_get(params, "adam_w_mode")) : std::nullopt;
    out.l2_decay = lower == "adam" && w_mode && !*w_mode;  // "AdamW" forces AdamW's update
  }
  return out;
}

Status check_zero_decay(const ZeroShapes& shapes, const std::vector<double>& weight_decay, const std::string& where) {
  if (!shapes.l2_decay) return Status::Ok();
  for (size_t g = 0; g < weight_decay.size(); ++g)
    if (weight_decay[g] != 0)
      return corrupt(fmt::format("{}: ds_config's optimizer is Adam with adam_w_mode false, and param group {} has "
                                 "weight_decay {}: Adam's L2 decay, not AdamW's decoupled decay", where, g,
                                 weight_decay[g]));
  return Status::Ok();
}

StorageSpec StorageSpec::of_component(const std::string& fqn, const std::string& entry, Component c) {
  StorageSpec s;
  s.fqn = fqn;
  s.entry = entry;
  s.component = c;
  return s;
}

StorageSpec StorageSpec::of_f32_values(const std::string& fqn, const std::string& entry) {
  StorageSpec s = of_component(fqn, entry);
  s.what = What::kF32Values;
  return s;
}

StorageSpec StorageSpec::of_qmap(const std::string& name) {
  StorageSpec s;
  s.what = What::kQMap;
  s.qmap = name;
  return s;
}

StorageSpec StorageSpec::of_scalar(float v) {
  StorageSpec s;
  s.what = What::kScalar;
  s.scalar = v;
  return s;
}

StorageSpec StorageSpec::of_model_tensor(size_t index) {
  StorageSpec s;
  s.what = What::kModelTensor;
  s.index = index;
  return s;
}

std::function<void(size_t index, const ModelTensorInfo&)> model_tensor_writer(pickle::Writer& w, const SpecSink& add) {
  return [&w, add](size_t index, const ModelTensorInfo& t) {
    dcp::encode_tensor(w, t.dtype, t.shape, add(StorageSpec::of_model_tensor(index)));
  };
}

Result<Plan> plan_of(const PlanFrame& frame, const FrameOptions& options) {
  Plan plan;
  pickle::Writer w;
  OPTSTATE_RETURN_IF_ERROR(frame(
      w,
      [&](StorageSpec s) {
        plan.storages.push_back(std::move(s));
        return std::to_string(plan.storages.size() - 1);
      },
      options));
  plan.data_pkl = w.finish();
  return plan;
}

std::vector<std::string> param_order(const OptimizerState& state) {
  std::vector<std::string> order;
  for (const ParamGroup& g : state.groups)
    for (const std::string& fqn : g.params) order.push_back(fqn);
  return order;
}

void encode_state_dict_frame(const OptimizerState& state, pickle::Writer& w, const FrameParts& parts) {
  const std::vector<std::string> order = param_order(state);
  bool numbered = true, weights = false;
  for (size_t i = 0; i < order.size(); ++i) {
    numbered = numbered && order[i] == std::to_string(i);
    weights = weights || state.params.at(order[i]).entries.count(kParam);
  }
  const bool others = parts.model_tensor && !parts.model_tensors.empty();
  const bool model = (weights || others) && !parts.optimizer_only;
  if (model) {
    w.empty_dict();
    w.mark();
    w.str("model");
    w.empty_dict();
    w.mark();
    for (size_t i = 0; i < order.size(); ++i) {
      const ParamState& ps = state.params.at(order[i]);
      if (!ps.entries.count(kParam)) continue;
      w.str(order[i]);
      parts.weight(i, ps);
    }
    if (others)
      for (size_t i = 0; i < parts.model_tensors.size(); ++i) {
        w.str(parts.model_tensors[i].name);
        parts.model_tensor(i, parts.model_tensors[i]);
      }
    w.setitems_from_mark();
    w.str("optimizer");
  }
  // Params [first, last) of the order (global indices i for the parts) in an optimizer's dict whose
  // ids start at 0, over groups [g0, g1).
  auto optimizer = [&](size_t first, size_t last, size_t g0, size_t g1, bool names) {
    w.empty_dict();
    w.mark();
    w.str("state");
    w.empty_dict();
    w.mark();
    for (size_t i = first; i < last; ++i) {
      const ParamState& ps = state.params.at(order[i]);
      if (!ps.entries.count(kExpAvg)) continue;  // never stepped: no state, as torch keeps it
      w.integer(static_cast<int64_t>(i - first));
      w.empty_dict();
      w.mark();
      parts.param_state(i, ps);
      w.setitems_from_mark();
    }
    w.setitems_from_mark();
    w.str("param_groups");
    w.empty_list();
    w.mark();
    size_t next = 0;
    for (size_t gi = g0; gi < g1; ++gi) {
      const ParamGroup& g = state.groups[gi];
      const Hyperparameters& h = g.hyper;
      w.empty_dict();
      w.mark();
      if (names) {
        w.str("param_names");
        w.empty_list();
        w.mark();
        for (const std::string& fqn : g.params) w.str(fqn);
        w.appends_from_mark();
      }
      w.str("lr");
      if (parts.lr)
        parts.lr(gi, h);
      else
        w.real(h.lr);
      w.str("betas");
      w.mark();
      w.real(h.beta1);
      w.real(h.beta2);
      w.tuple_from_mark();
      w.str("eps");
      w.real(h.eps);
      w.str("weight_decay");
      w.real(h.weight_decay);
      parts.group_fields(gi, h);
      if (parts.group_extra) parts.group_extra(gi);
      w.str("params");
      w.empty_list();
      w.mark();
      for (size_t k = 0; k < g.params.size(); ++k) w.integer(static_cast<int64_t>(next++));
      w.appends_from_mark();
      w.setitems_from_mark();
    }
    w.appends_from_mark();
    w.setitems_from_mark();
  };
  if (parts.per_param) {
    // {fqn: one optimizer's state_dict over [param]}: each group holds one param, or none where the
    // source's optimizer never stepped its param (checked by the caller).
    w.empty_dict();
    w.mark();
    for (size_t g = 0, i = 0; g < state.groups.size(); ++g) {
      if (state.groups[g].params.empty()) {
        parts.stateless_optimizer(g);
        continue;
      }
      w.str(order[i]);
      optimizer(i, i + 1, g, g + 1, /*names=*/false);
      ++i;
    }
    w.setitems_from_mark();
  } else {
    optimizer(0, order.size(), 0, state.groups.size(), !numbered);
  }
  if (model) w.setitems_from_mark();
}

void adamw_group_fields(pickle::Writer& w, const Hyperparameters& h, const AdamWFlags* kept) {
  w.str("amsgrad");
  w.boolean(h.amsgrad);
  w.str("maximize");
  w.boolean(h.maximize);
  // The rest of torch.optim.AdamW's group (2.13), as its state_dict() has it: the source's switches
  // where it kept them (torch's load_state_dict takes the group as saved: fused=True stays fused).
  for (const auto& [name, fallback] : kAdamWFlagDefaults) {
    w.str(std::string(name));
    dcp::encode_flag(w, dcp::written_flag(kept, name, fallback));
  }
}

std::function<void(size_t group)> group_extras_writer(pickle::Writer& w, const SpecSink& add,
                                                      const FrameOptions& options, size_t groups, bool tensor_lr) {
  return [&w, add, &options, groups, tensor_lr](size_t g) {
    if (const GroupExtras* kept = dcp::source_extras(options.group_extras, groups, g))
      for (const auto& [key, v] : *kept) {
        w.str(key);
        if (v.kind == GroupValue::Kind::kTensor && tensor_lr)
          dcp::encode_tensor(w, DType::kF32, v.shape, add(StorageSpec::of_scalar(static_cast<float>(v.f))));
        else
          dcp::encode_group_value(w, v);
      }
    if (options.group_extra) options.group_extra(g);
  };
}

namespace {

// The state as torch.optim.AdamW holds it: every entry dense, 8-bit moments as fp32.
OptimizerState dense_view(const OptimizerState& meta) {
  OptimizerState out = meta;
  for (auto& [fqn, ps] : out.params)
    for (auto& [name, e] : ps.entries)
      if (e.encoding == Encoding::kBlockwise8) {
        e.encoding = Encoding::kDense;
        e.dtype = DType::kF32;
        e.block_size = 0;
        e.qmap.clear();
      }
  return out;
}

}  // namespace

Status plan_adamw_frame(const OptimizerState& meta, pickle::Writer& w, const SpecSink& add,
                        const FrameOptions& options) {
  const std::vector<std::string> order = param_order(meta);
  const OptimizerState dense = dense_view(meta);
  encode_state_dict_frame(dense, w, {
      .weight =
          [&](size_t i, const ParamState& ps) {
            dcp::encode_tensor(w, ps.entries.at(kParam).dtype, ps.shape, add(StorageSpec::of_component(order[i], kParam)));
          },
      .param_state =
          [&](size_t i, const ParamState& ps) {
            w.str("step");
            dcp::encode_tensor(w, DType::kF32, {}, add(StorageSpec::of_scalar(static_cast<float>(ps.step))));
            for (const char* m : {kExpAvg, kExpAvgSq, kMaxExpAvgSq}) {
              const auto e = meta.params.at(order[i]).entries.find(m);
              if (e == meta.params.at(order[i]).entries.end()) continue;
              w.str(m);
              if (e->second.encoding == Encoding::kDense)
                dcp::encode_tensor(w, e->second.dtype, ps.shape, add(StorageSpec::of_component(order[i], m)));
              else
                dcp::encode_tensor(w, DType::kF32, ps.shape, add(StorageSpec::of_f32_values(order[i], m)));
            }
          },
      .group_fields =
          [&](size_t g, const Hyperparameters& h) {
            adamw_group_fields(w, h, dcp::source_flags(options.adamw_flags, meta.groups.size(), g));
          },
      .lr = {},
      .optimizer_only = options.optimizer_only,
      .group_extra = group_extras_writer(w, add, options, meta.groups.size(), /*tensor_lr=*/false),
      .model_tensors = options.model_tensors,
      .model_tensor = model_tensor_writer(w, add),
      .per_param = options.per_param,
      .stateless_optimizer = options.stateless_optimizer,
  });
  return Status::Ok();
}

}  // namespace optstate::torchsave
