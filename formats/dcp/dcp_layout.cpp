#include "dcp_layout.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>

#include "optstate/state.h"

namespace optstate::dcp {

using pickle::Kind;
using pickle::kNoRef;
using pickle::Pickle;
using pickle::Ref;

// A dataclass's fields: BUILD state as a dict, or (None, slots dict) for slotted classes.
Ref fields_of(const Pickle& p, Ref obj) {
  if (obj == kNoRef || p.at(obj).kind != Kind::kObject) return kNoRef;
  Ref st = p.at(obj).state;
  if (st == kNoRef) return kNoRef;
  const auto& v = p.at(st);
  if (v.kind == Kind::kDict) return st;
  if (v.kind == Kind::kTuple && v.items.size() == 2 && p.at(v.items[1]).kind == Kind::kDict) return v.items[1];
  return kNoRef;
}

bool is_instance(const Pickle& p, Ref obj, std::string_view module, std::string_view name) {
  return obj != kNoRef && p.at(obj).kind == Kind::kObject && p.is_global(p.at(obj).callable, module, name);
}

std::optional<std::vector<int64_t>> int_tuple(const Pickle& p, Ref r) {
  if (r == kNoRef) return std::nullopt;
  const auto& v = p.at(r);
  if (v.kind != Kind::kTuple && v.kind != Kind::kList) return std::nullopt;
  std::vector<int64_t> out;
  for (Ref x : v.items) {
    if (p.at(x).kind != Kind::kInt) return std::nullopt;
    out.push_back(p.at(x).i);
  }
  return out;
}

// torch.Size((d0, d1, ...)) is REDUCE(torch.Size, ((d0, d1, ...),)); plain tuples are accepted too.
std::optional<std::vector<int64_t>> torch_size(const Pickle& p, Ref r) {
  if (r == kNoRef) return std::nullopt;
  if (is_instance(p, r, "torch", "Size")) {
    const auto& args = p.at(p.at(r).args);
    if (args.items.size() != 1) return std::nullopt;
    return int_tuple(p, args.items[0]);
  }
  return int_tuple(p, r);
}

const std::array<float, 256>& float8_e4m3fn_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) {
      const int sign = b >> 7, exp = (b >> 3) & 15, mant = b & 7;
      float v;
      if (exp == 15 && mant == 7) v = std::numeric_limits<float>::quiet_NaN();  // e4m3fn: no infinities
      else if (exp == 0) v = std::ldexp(static_cast<float>(mant), -9);          // subnormal: mant/8 * 2^-6
      else v = std::ldexp(1.0f + static_cast<float>(mant) / 8.0f, exp - 7);
      t[static_cast<size_t>(b)] = sign ? -v : v;
    }
    return t;
  }();
  return table;
}

std::optional<DType> torch_dtype(const Pickle& p, Ref r) {
  if (r == kNoRef || p.at(r).kind != Kind::kGlobal || p.at(r).s != "torch") return std::nullopt;
  return dtype_from_torch_name(p.at(r).name());
}


namespace {

std::optional<std::string> str(const Pickle& p, Ref r) {
  if (r == kNoRef || p.at(r).kind != Kind::kStr) return std::nullopt;
  return p.at(r).s;
}

constexpr const char* kMetaModule = "torch.distributed.checkpoint.metadata";

Result<TensorRef> tensor_args(const Pickle& p, bool v3, Ref args_ref, const std::string& where, bool fp8 = false);

// Whether `r` rebuilds a plain tensor (torch._utils._rebuild_tensor_v2 or _v3).
bool is_tensor_rebuild(const Pickle& p, Ref r) {
  return is_instance(p, r, "torch._utils", "_rebuild_tensor_v2") || is_instance(p, r, "torch._utils", "_rebuild_tensor_v3");
}

// `fp8`: the tensor must be float8_e4m3fn (torchao's OptimStateFp8 codes) and is returned as its
// bytes (kU8), which the state dequantizes; any other float8 tensor (a frozen fp8 weight) keeps its
// dtype and is carried as it is.

Result<TensorRef> tensor_ref(const Pickle& p, Ref r, const std::string& where, bool fp8 = false) {
  if (!is_tensor_rebuild(p, r))
    return corrupt(fmt::format("{}: expected a tensor (torch._utils._rebuild_tensor_v2/_v3)", where));
  return tensor_args(p, is_instance(p, r, "torch._utils", "_rebuild_tensor_v3"), p.at(r).args, where, fp8);
}

// The arguments of _rebuild_tensor_v2 (storage, offset, size, stride, ...) or _v3 (..., dtype).
Result<TensorRef> tensor_args(const Pickle& p, bool v3, Ref args_ref, const std::string& where, bool fp8) {
  if (args_ref == kNoRef || (p.at(args_ref).kind != Kind::kTuple && p.at(args_ref).kind != Kind::kList))
    return corrupt(fmt::format("{}: tensor rebuild without its arguments", where));
  const auto& args = p.at(args_ref).items;
  if (args.size() < (v3 ? 7u : 4u)) return corrupt(fmt::format("{}: tensor rebuild with too few arguments", where));
  const Ref pid_ref = args[0];
  if (p.at(pid_ref).kind != Kind::kPersId) return corrupt(fmt::format("{}: tensor without a storage", where));
  const auto& pid = p.at(p.at(pid_ref).pid);
  if (pid.kind != Kind::kTuple || pid.items.size() != 5 || str(p, pid.items[0]) != "storage" ||
      p.at(pid.items[1]).kind != Kind::kGlobal || !str(p, pid.items[2]) || p.at(pid.items[4]).kind != Kind::kInt)
    return corrupt(fmt::format("{}: storage reference is not ('storage', class, key, location, numel)", where));
  TensorRef t;
  t.storage_key = *str(p, pid.items[2]);
  if (t.storage_key.empty() || t.storage_key.find('/') != std::string::npos || t.storage_key.find("..") != std::string::npos)
    return corrupt(fmt::format("{}: storage key '{}' is not a plain name", where, t.storage_key));
  const auto& cls = p.at(pid.items[1]);
  int64_t numel = p.at(pid.items[4]).i;
  if (v3) {
    auto d = torch_dtype(p, args[6]);
    if (fp8) {
      if (p.at(args[6]).kind != Kind::kGlobal || p.at(args[6]).s != "torch" || p.at(args[6]).name() != "float8_e4m3fn")
        return corrupt(fmt::format("{}: not a float8_e4m3fn tensor", where));
      d = DType::kU8;  // its bit patterns
    }
    if (!d) return corrupt(fmt::format("{}: unsupported tensor dtype", where));
    t.dtype = *d;
    if (cls.name() != "UntypedStorage") return corrupt(fmt::format("{}: _rebuild_tensor_v3 without UntypedStorage", where));
    if (numel % dtype_size(t.dtype)) return corrupt(fmt::format("{}: storage bytes not a multiple of the dtype", where));
    numel /= dtype_size(t.dtype);
  } else {
    auto d = cls.s == "torch" ? dtype_from_torch_storage(cls.name()) : std::nullopt;
    if (!d) return corrupt(fmt::format("{}: unsupported storage class {}.{}", where, cls.s, cls.name()));
    t.dtype = *d;
  }
  if (numel < 0 || numel > kMaxNumel) return corrupt(fmt::format("{}: storage of {} elements", where, numel));
  t.storage_numel = numel;
  if (p.at(args[1]).kind != Kind::kInt) return corrupt(fmt::format("{}: storage offset is not an integer", where));
  t.offset = p.at(args[1]).i;
  auto shape = int_tuple(p, args[2]);
  auto stride = int_tuple(p, args[3]);
  if (!shape || !stride || shape->size() != stride->size() || shape->size() > static_cast<size_t>(kMaxRank))
    return corrupt(fmt::format("{}: tensor size/stride are not matching integer tuples", where));
  t.shape = *shape;
  auto n = checked_numel(t.shape);
  if (!n.ok()) return n.status().with_context(where);
  // C-contiguous, or a permutation of a dense layout: its dims of more than one element, taken from
  // the smallest stride up, each stride the product of the sizes before it (so no element is held
  // twice and none is skipped); inside the storage either way.
  int64_t expect = 1;
  bool contiguous = true;
  for (size_t k = t.shape.size(); k-- > 0;) {
    if (t.shape[k] != 1 && (*stride)[k] != expect) contiguous = false;
    expect *= t.shape[k];
  }
  if (!contiguous && *n > 0) {  // an empty tensor holds nothing to order
    std::vector<size_t> dims;
    for (size_t k = 0; k < t.shape.size(); ++k)
      if (t.shape[k] != 1) dims.push_back(k);
    std::stable_sort(dims.begin(), dims.end(), [&](size_t a, size_t b) { return (*stride)[a] < (*stride)[b]; });
    int64_t dense = 1;
    for (size_t k : dims) {
      if ((*stride)[k] != dense)
        return corrupt(fmt::format("{}: tensor of shape [{}] with strides [{}] is neither C-contiguous nor a permutation "
                                   "of a dense layout (stride {} of dim {}); not supported", where,
                                   fmt::join(t.shape, ", "), fmt::join(*stride, ", "), (*stride)[k], k));
      dense *= t.shape[k];
    }
    t.stride = *stride;
    for (size_t k = 0; k < t.shape.size(); ++k)
      if (t.shape[k] == 1) t.stride[k] = 0;  // never stepped over
  }
  if (t.offset < 0 || t.offset > numel || *n > numel - t.offset)
    return corrupt(fmt::format("{}: tensor of {} elements at offset {} overruns its storage of {}", where, *n, t.offset,
                               numel));
  return t;
}

}  // namespace

void to_logical_order(const TensorRef& t, int64_t elem, std::span<const std::byte> stored, std::span<std::byte> out) {
  // An odometer over the logical index, innermost dim fastest; `from` is the stored element's index.
  const size_t rank = t.shape.size();
  const int64_t numel = static_cast<int64_t>(out.size()) / elem;
  std::vector<int64_t> index(rank, 0);
  int64_t from = 0;
  const auto e = static_cast<size_t>(elem);
  for (int64_t i = 0; i < numel; ++i) {
    std::memcpy(out.data() + static_cast<size_t>(i) * e, stored.data() + static_cast<size_t>(from) * e, e);
    for (size_t k = rank; k-- > 0;) {
      if (++index[k] < t.shape[k]) {
        from += t.stride[k];
        break;
      }
      from -= (t.shape[k] - 1) * t.stride[k];
      index[k] = 0;
    }
  }
}

Status require_contiguous(const TensorRef& t, const std::string& where) {
  if (!t.permuted()) return Status::Ok();
  return corrupt(fmt::format("{}: tensor of shape [{}] stored with strides [{}] (not C-contiguous); only dense values "
                             "are read in another layout, not 8-bit codes, scales or maps", where,
                             fmt::join(t.shape, ", "), fmt::join(t.stride, ", ")));
}

std::optional<double> as_number(const Pickle& p, Ref r) {
  if (r == kNoRef) return std::nullopt;
  const auto& v = p.at(r);
  if (v.kind == Kind::kFloat) return v.f;
  if (v.kind == Kind::kInt || v.kind == Kind::kBool) return static_cast<double>(v.i);
  return std::nullopt;
}

std::optional<bool> as_bool(const Pickle& p, Ref r) {
  if (r == kNoRef || (p.at(r).kind != Kind::kBool && p.at(r).kind != Kind::kInt)) return std::nullopt;
  return p.at(r).i != 0;
}

std::optional<std::string> as_string(const Pickle& p, Ref r) { return str(p, r); }

std::optional<FlagValue> as_flag(const Pickle& p, Ref r) {
  if (r == kNoRef) return std::nullopt;
  if (p.at(r).kind == Kind::kNone) return FlagValue::kNone;
  if (p.at(r).kind != Kind::kBool) return std::nullopt;
  return p.at(r).i != 0 ? FlagValue::kTrue : FlagValue::kFalse;
}

const AdamWFlags* source_flags(std::span<const AdamWFlags> source, size_t groups, size_t g) {
  return source.size() == groups && g < groups ? &source[g] : nullptr;
}

FlagValue written_flag(const AdamWFlags* kept, std::string_view name, FlagValue fallback) {
  if (!kept) return fallback;
  const auto it = kept->find(name);
  return it == kept->end() ? fallback : it->second;
}

void encode_flag(pickle::Writer& w, FlagValue v) {
  if (v == FlagValue::kNone)
    w.none();
  else
    w.boolean(v == FlagValue::kTrue);
}

namespace {
const std::set<std::string, std::less<>> kKnownGroupKeys = {
    "params", "param_names", "lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach",
    "capturable", "differentiable", "fused", "decoupled_weight_decay", "block_size", "min_8bit_size",
    "exp_avg_qmap", "exp_avg_sq_qmap", "bf16_stochastic_round", "is_adamw", "adam_w_mode", "adamw_mode",
    "bias_correction",
    // bitsandbytes' AdEMAMix fields, in every Optimizer2State's groups; inert for two betas (Adam).
    "alpha", "t_alpha", "t_beta3"};
}  // namespace

bool known_group_key(std::string_view key) { return kKnownGroupKeys.count(key) > 0; }

Status check_torch_adam_group(const std::function<bool(const char*)>& has, const std::string& where) {
  // Other optimizers' groups (none keeps 'betas'), named by a key only they keep, so that their
  // file is refused for what it is rather than for a missing 'betas'. An AdamW group with such a
  // key of its own (a scheduler's 't0') has betas and reads.
  static constexpr std::pair<const char*, const char*> kOtherOptimizers[] = {
      {"ns_steps", "torch.optim.Muon's"},
      {"dampening", "torch.optim.SGD's"},
      {"initial_accumulator_value", "torch.optim.Adagrad's"},
      {"centered", "torch.optim.RMSprop's"},
      {"rho", "torch.optim.Adadelta's"},
      {"beta2_decay", "torch.optim.Adafactor's"},
      {"relative_step", "transformers' Adafactor's"},
      {"etas", "torch.optim.Rprop's"},
      {"t0", "torch.optim.ASGD's"},
      {"tolerance_grad", "torch.optim.LBFGS's"},
  };
  for (const auto& [key, name] : kOtherOptimizers)
    if (!has("betas") && has(key)) return corrupt(fmt::format("{}: '{}' is {} group: not AdamW's", where, key, name));
  // torch.optim.NAdam's and RAdam's state has AdamW's keys (exp_avg, exp_avg_sq, step; NAdam's
  // mu_product besides), and their updates are others. torch's Adam and AdamW groups always keep
  // 'amsgrad' beside the keys every torch.optim group has; NAdam's and RAdam's never do.
  if (has("momentum_decay"))
    return corrupt(where + ": 'momentum_decay' is torch.optim.NAdam's group: its update is not AdamW's");
  // GaLore's and APOLLO's (transformers' optim="galore_adamw", "apollo_adamw"): AdamW's keys, the
  // moments of the gradient projected to `rank` (another shape than the param's), the update
  // projected back.
  if (has("update_proj_gap"))
    return corrupt(where + ": 'update_proj_gap' is GaLore's or APOLLO's group (its moments are of the gradient "
                           "projected to a low rank, in another shape than the param's): not AdamW's");
  // GrokAdamW's (transformers' optim="grokadamw"): AdamW's moments of the gradient amplified by
  // its own EMA of it ('grok_ema' in the state).
  if (has("alpha_init"))
    return corrupt(where + ": 'alpha_init' is GrokAdamW's group (its moments are of the gradient amplified by an "
                           "EMA of it): not AdamW's");
  // ADOPT's (its own package; timm's Adopt): AdamW's keys, the second moment updated before the
  // first, the gradient normalized by the old one and clipped.
  for (const char* key : {"clip_exp", "clip_lambda", "decouple"})
    if (has(key))
      return corrupt(fmt::format("{}: '{}' is ADOPT's group (the gradient normalized by the previous second moment): "
                                 "not AdamW's", where, key));
  // Schedule-free AdamW's (facebookresearch/schedule_free): its state z and exp_avg_sq, the
  // weights an average of z's.
  if (has("weight_lr_power"))
    return corrupt(where + ": 'weight_lr_power' is schedule-free AdamW's group (its state z and an averaged "
                           "iterate, no first moment): not AdamW's");
  // LAMB's (apex's FusedLAMB, timm's Lamb): AdamW's moments, a trust ratio on the update.
  for (const char* key : {"grad_averaging", "max_grad_norm", "trust_clip", "always_adapt"})
    if (has(key))
      return corrupt(fmt::format("{}: '{}' is LAMB's group (a trust ratio scales its update): not AdamW's", where, key));
  if (!has("amsgrad"))
    for (const char* key : {"foreach", "capturable", "differentiable", "decoupled_weight_decay"})
      if (has(key))
        return corrupt(fmt::format("{}: a torch.optim group with '{}' and no 'amsgrad' (RAdam's, NAdam's or Adamax's, "
                                   "whose updates are not AdamW's; torch's Adam and AdamW keep amsgrad)", where, key));
  return Status::Ok();
}

std::optional<GroupValue> as_group_value(const Pickle& p, Ref r) {
  if (r == kNoRef) return std::nullopt;
  const pickle::Value& v = p.at(r);
  GroupValue out;
  switch (v.kind) {
    case Kind::kNone: out.kind = GroupValue::Kind::kNone; return out;
    case Kind::kBool: out.kind = GroupValue::Kind::kBool; out.i = v.i != 0; return out;
    case Kind::kInt: out.kind = GroupValue::Kind::kInt; out.i = v.i; return out;
    case Kind::kFloat: out.kind = GroupValue::Kind::kFloat; out.f = v.f; return out;
    case Kind::kStr: out.kind = GroupValue::Kind::kString; out.s = v.s; return out;
    default: return std::nullopt;
  }
}

void encode_group_value(pickle::Writer& w, const GroupValue& v) {
  switch (v.kind) {
    case GroupValue::Kind::kNone: w.none(); break;
    case GroupValue::Kind::kBool: w.boolean(v.i != 0); break;
    case GroupValue::Kind::kInt: w.integer(v.i); break;
    case GroupValue::Kind::kString: w.str(v.s); break;
    case GroupValue::Kind::kFloat:
    case GroupValue::Kind::kTensor: w.real(v.f); break;
  }
}

const GroupExtras* source_extras(std::span<const GroupExtras> source, size_t groups, size_t g) {
  return source.size() == groups && g < groups ? &source[g] : nullptr;
}

std::string group_value_text(const GroupValue& v) {
  switch (v.kind) {
    case GroupValue::Kind::kNone: return "None";
    case GroupValue::Kind::kBool: return v.i ? "True" : "False";
    case GroupValue::Kind::kInt: return std::to_string(v.i);
    case GroupValue::Kind::kFloat: return fmt::format("{:g}", v.f);
    case GroupValue::Kind::kString: return fmt::format("'{}'", v.s);
    case GroupValue::Kind::kTensor: return fmt::format("tensor({:g})", v.f);
  }
  return "?";
}

std::optional<std::vector<std::string>> as_string_list(const Pickle& p, Ref r) {
  if (r == kNoRef || (p.at(r).kind != Kind::kList && p.at(r).kind != Kind::kTuple)) return std::nullopt;
  std::vector<std::string> out;
  for (Ref x : p.at(r).items) {
    auto s = str(p, x);
    if (!s) return std::nullopt;
    out.push_back(*s);
  }
  return out;
}

std::optional<std::vector<int64_t>> as_int_list(const Pickle& p, Ref r) { return int_tuple(p, r); }

Result<Metadata> interpret_metadata(const Pickle& p, const std::string& where) {
  const Ref root = p.root();
  // Megatron-Core 0.15's planner saves its own subclass, the same fields and `mcore_data`.
  if (!is_instance(p, root, kMetaModule, "Metadata") &&
      !is_instance(p, root, "megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata"))
    return corrupt(fmt::format("{}: not a DCP Metadata object", where));
  const Ref f = fields_of(p, root);
  const Ref sdm = p.dict_get(f, "state_dict_metadata");
  if (sdm == kNoRef || p.at(sdm).kind != Kind::kDict)
    return corrupt(fmt::format("{}: Metadata without state_dict_metadata", where));
  Metadata m;
  const auto& items = p.at(sdm).items;
  for (size_t k = 0; k + 1 < items.size(); k += 2) {
    auto key = str(p, items[k]);
    if (!key) return corrupt(fmt::format("{}: a state_dict_metadata key is not a string", where));
    const std::string iw = fmt::format("{}: item '{}'", where, *key);
    const Ref v = items[k + 1];
    ItemMeta im;
    if (is_instance(p, v, kMetaModule, "BytesStorageMetadata")) {
      im.is_tensor = false;
    } else if (is_instance(p, v, kMetaModule, "TensorStorageMetadata")) {
      im.is_tensor = true;
      const Ref tf = fields_of(p, v);
      const Ref props = p.dict_get(tf, "properties");
      // TensorProperties pickles its state as (dtype, layout, requires_grad, memory_format, pin_memory).
      const Ref ps = props != kNoRef && p.at(props).kind == Kind::kObject ? p.at(props).state : kNoRef;
      std::optional<DType> d;
      if (ps != kNoRef && p.at(ps).kind == Kind::kTuple && !p.at(ps).items.empty())
        d = torch_dtype(p, p.at(ps).items[0]);
      else if (ps != kNoRef)
        d = torch_dtype(p, p.dict_get(ps, "dtype"));
      if (!d) return corrupt(iw + ": unsupported or missing dtype");
      im.dtype = *d;
      auto size = torch_size(p, p.dict_get(tf, "size"));
      if (!size || size->size() > static_cast<size_t>(kMaxRank)) return corrupt(iw + ": size is not a torch.Size");
      im.size = *size;
      auto numel = checked_numel(im.size);
      if (!numel.ok()) return numel.status().with_context(iw);
      const Ref chunks = p.dict_get(tf, "chunks");
      if (chunks == kNoRef || p.at(chunks).kind != Kind::kList) return corrupt(iw + ": chunks is not a list");
      for (Ref c : p.at(chunks).items) {
        if (!is_instance(p, c, kMetaModule, "ChunkStorageMetadata")) return corrupt(iw + ": a chunk is not a ChunkStorageMetadata");
        const Ref cf = fields_of(p, c);
        auto off = torch_size(p, p.dict_get(cf, "offsets"));
        auto sz = torch_size(p, p.dict_get(cf, "sizes"));
        if (!off || !sz || off->size() != im.size.size() || sz->size() != im.size.size())
          return corrupt(iw + ": chunk offsets/sizes do not match the tensor's rank");
        for (size_t dim = 0; dim < im.size.size(); ++dim)
          if ((*off)[dim] < 0 || (*sz)[dim] < 0 || (*off)[dim] > im.size[dim] || (*sz)[dim] > im.size[dim] - (*off)[dim])
            return corrupt(fmt::format("{}: chunk at {} of size {} lies outside {}", iw, format_shape(*off),
                                       format_shape(*sz), format_shape(im.size)));
        im.chunks.push_back({*off, *sz});
      }
      if (im.chunks.size() > (size_t{1} << 20)) return corrupt(iw + ": too many chunks");
    } else {
      return corrupt(iw + ": neither TensorStorageMetadata nor BytesStorageMetadata");
    }
    if (m.items.emplace(*key, std::move(im)).second) m.order.push_back(*key);
  }

  const Ref sd = p.dict_get(f, "storage_data");
  if (sd == kNoRef || p.at(sd).kind != Kind::kDict) return corrupt(fmt::format("{}: Metadata without storage_data", where));
  const auto& sitems = p.at(sd).items;
  for (size_t k = 0; k + 1 < sitems.size(); k += 2) {
    const Ref idx = sitems[k], info = sitems[k + 1];
    if (!is_instance(p, idx, kMetaModule, "MetadataIndex"))
      return corrupt(fmt::format("{}: a storage_data key is not a MetadataIndex", where));
    const Ref xf = fields_of(p, idx);
    auto fqn = str(p, p.dict_get(xf, "fqn"));
    if (!fqn) return corrupt(fmt::format("{}: MetadataIndex without fqn", where));
    std::vector<int64_t> offsets;
    const Ref off = p.dict_get(xf, "offset");
    if (off != kNoRef && p.at(off).kind != Kind::kNone) {
      auto o = torch_size(p, off);
      if (!o) return corrupt(fmt::format("{}: MetadataIndex '{}' offset is not a torch.Size", where, *fqn));
      offsets = *o;
    }
    // torch's FileSystemWriter (and FsspecWriter) pickle torch's dataclass; OLMo-core's
    // RemoteFileSystemWriter its own copy of it, the same three fields.
    if (!is_instance(p, info, "torch.distributed.checkpoint.filesystem", "_StorageInfo") &&
        !is_instance(p, info, "olmo_core.distributed.checkpoint.filesystem", "_StorageInfo"))
      return corrupt(fmt::format("{}: storage of '{}' is not a _StorageInfo", where, *fqn));
    const Ref sf = fields_of(p, info);
    StorageLoc loc;
    auto rel = str(p, p.dict_get(sf, "relative_path"));
    const Ref o = p.dict_get(sf, "offset"), l = p.dict_get(sf, "length");
    if (!rel || o == kNoRef || l == kNoRef || p.at(o).kind != Kind::kInt || p.at(l).kind != Kind::kInt)
      return corrupt(fmt::format("{}: storage of '{}' needs relative_path, offset and length", where, *fqn));
    if (p.at(o).i < 0 || p.at(l).i < 0)
      return corrupt(fmt::format("{}: storage of '{}' has a negative offset or length ({}, {})", where, *fqn,
                                 p.at(o).i, p.at(l).i));
    loc.relative_path = *rel;
    loc.offset = static_cast<uint64_t>(p.at(o).i);
    loc.length = static_cast<uint64_t>(p.at(l).i);
    if (const Ref td = p.dict_get(sf, "transform_descriptors"); td != kNoRef && p.at(td).kind != Kind::kNone) {
      if (p.at(td).kind != Kind::kList && p.at(td).kind != Kind::kTuple)
        return corrupt(fmt::format("{}: storage of '{}' has transform_descriptors that are not a list", where, *fqn));
      for (Ref d : p.at(td).items) {
        auto desc = str(p, d);
        if (!desc) return corrupt(fmt::format("{}: storage of '{}' has a transform descriptor that is not a string", where, *fqn));
        loc.transforms.push_back(*desc);
      }
    }
    if (!m.storage.emplace(std::pair{*fqn, offsets}, loc).second)
      return corrupt(fmt::format("{}: storage of '{}' at {} is listed twice", where, *fqn, format_shape(offsets)));
  }

  const Ref pd = p.dict_get(f, "planner_data");
  if (pd != kNoRef && p.at(pd).kind == Kind::kDict) {
    const auto& pitems = p.at(pd).items;
    for (size_t k = 0; k + 1 < pitems.size(); k += 2) {
      auto key = str(p, pitems[k]);
      const Ref path = pitems[k + 1];
      if (!key || (p.at(path).kind != Kind::kTuple && p.at(path).kind != Kind::kList)) continue;
      std::vector<std::string> parts;
      std::vector<bool> index;
      for (Ref x : p.at(path).items) {
        const bool is_int = p.at(x).kind == Kind::kInt;
        if (!is_int && p.at(x).kind != Kind::kStr) {
          parts.clear();
          break;
        }
        parts.push_back(is_int ? std::to_string(p.at(x).i) : p.at(x).s);
        index.push_back(is_int);
      }
      if (!parts.empty()) {
        // torch's flatten_state_dict keys each item by its path joined with '.' (and refuses two
        // alike): a path that spells another key would file the item as another one's.
        std::string joined;
        for (const std::string& part : parts) joined += (joined.empty() ? "" : ".") + part;
        if (joined != *key)
          return corrupt(fmt::format("{}: item '{}' has the planner path '{}', which is another key", where, *key, joined));
        m.planner[*key] = std::move(parts);
        m.planner_index[*key] = std::move(index);
      }
    }
  }

  // Megatron-Core's MCoreSavePlanner adds mcore_data: {key: {} or {'nd_reformulated_orig_global_shape': shape}}.
  const Ref mc = p.dict_get(f, "mcore_data");
  if (mc != kNoRef && p.at(mc).kind == Kind::kDict) {
    const auto& mitems = p.at(mc).items;
    for (size_t k = 0; k + 1 < mitems.size(); k += 2) {
      auto key = str(p, mitems[k]);
      if (!key || p.at(mitems[k + 1]).kind != Kind::kDict)
        return corrupt(fmt::format("{}: mcore_data holds an entry that is not a key and a dict", where));
      const Ref shape = p.dict_get(mitems[k + 1], "nd_reformulated_orig_global_shape");
      if (shape == kNoRef) continue;
      const std::string iw = fmt::format("{}: item '{}'", where, *key);
      const auto it = m.items.find(*key);
      if (it == m.items.end() || !it->second.is_tensor)
        return corrupt(iw + ": mcore_data gives its N-D shape, and the metadata holds no such tensor");
      auto nd = int_tuple(p, shape);
      if (!nd || nd->size() > static_cast<size_t>(kMaxRank))
        return corrupt(iw + ": mcore_data's nd_reformulated_orig_global_shape is not a shape");
      OPTSTATE_RETURN_IF_ERROR(check_nd_flattened(it->second, *nd, iw));
      it->second.nd_shape = std::move(*nd);
    }
  }
  return m;
}

Status check_nd_flattened(const ItemMeta& im, const std::vector<int64_t>& nd, const std::string& where) {
  const auto bad = [&](const std::string& why) {
    return corrupt(fmt::format("{}: an N-D flattened item of size {} for a tensor of shape {}: {}", where,
                               format_shape(im.size), format_shape(nd), why));
  };
  if (im.size.size() != nd.size() + 1) return bad("not one axis more than the tensor");
  if (const auto n = checked_numel(nd); !n.ok() || *n == 0) return bad("an empty or oversized tensor");
  int64_t box = 1;
  for (size_t d = 0; d < nd.size(); ++d) {
    if (nd[d] < 0 || im.size[d] <= 0 || nd[d] % im.size[d] != 0) return bad(fmt::format("axis {} is not cut in equal chunks", d));
    box *= nd[d] / im.size[d];  // no overflow: at most the tensor's numel
  }
  if (box != im.size.back()) return bad(fmt::format("a chunk of that shape holds {} elements", box));
  for (const ChunkMeta& c : im.chunks)
    for (size_t d = 0; d < nd.size(); ++d)
      if (c.sizes[d] != 1) return bad(fmt::format("a chunk at {} spans several chunk boxes", format_shape(c.offsets)));
  return Status::Ok();
}

Result<Payload> interpret_payload(const Pickle& p, const std::string& where) { return interpret_value(p, p.root(), where); }

Result<double> adamw_decay_of_decoupled(double weight_decay, std::optional<double> initial_lr, size_t group,
                                        const std::string& group_where, std::vector<std::string>& notes) {
  if (weight_decay == 0) return 0.0;
  if (!initial_lr || !(*initial_lr > 0) || !std::isfinite(*initial_lr) || !std::isfinite(weight_decay / *initial_lr))
    return corrupt(fmt::format("{}: Composer's DecoupledAdamW with weight_decay {} and no positive 'initial_lr': its "
                               "decay is not scaled by lr, which no AdamW weight decay is",
                               group_where, weight_decay));
  const double adamw = weight_decay / *initial_lr;
  notes.push_back(fmt::format("param group {}: weight_decay {} is Composer's DecoupledAdamW's (not scaled by lr), read "
                              "as AdamW's {} (divided by initial_lr {})", group, weight_decay, adamw, *initial_lr));
  return adamw;
}

std::string_view torchao_subclass_package(const Pickle& p, Ref r, std::string_view module, std::string_view name) {
  for (std::string_view package : kTorchaoOptimPackages)
    if (p.is_global(r, std::string(package) + "." + std::string(module), name)) return package;
  return {};
}

bool is_torchao_package(std::string_view package) {
  return std::find(std::begin(kTorchaoOptimPackages), std::end(kTorchaoOptimPackages), package) !=
         std::end(kTorchaoOptimPackages);
}

// torchao float8 training's weight wrappers (torchao.float8.fsdp_utils; the module path may move
// within torchao.float8).
static bool is_float8_weight_wrapper(const Pickle& p, Ref cls) {
  if (cls == kNoRef || p.at(cls).kind != Kind::kGlobal || p.at(cls).s.rfind("torchao.float8", 0) != 0) return false;
  const std::string_view name = p.at(cls).name();
  return name == "WeightWithDynamicFloat8CastTensor" || name == "WeightWithDelayedFloat8CastTensor" ||
         name == "WeightWithStaticFloat8CastTensor";
}

Result<Payload> interpret_value(const Pickle& p, Ref root, const std::string& where) {
  Payload out;
  if (is_tensor_rebuild(p, root)) {
    out.kind = Payload::Kind::kTensor;
    OPTSTATE_ASSIGN_OR_RETURN(out.tensor, tensor_ref(p, root, where));
    return out;
  }
  // An nn.Parameter (a state_dict(keep_vars=True), a pickled module's params):
  // _rebuild_parameter(data, requires_grad, backward_hooks) or _rebuild_parameter_with_state(...,
  // state); its data is the tensor.
  if ((is_instance(p, root, "torch._utils", "_rebuild_parameter") ||
       is_instance(p, root, "torch._utils", "_rebuild_parameter_with_state")) &&
      p.at(root).args != kNoRef && !p.at(p.at(root).args).items.empty()) {
    const Ref data = p.at(p.at(root).args).items[0];
    if (is_tensor_rebuild(p, data)) {
      out.kind = Payload::Kind::kTensor;
      OPTSTATE_ASSIGN_OR_RETURN(out.tensor, tensor_ref(p, data, where + " (an nn.Parameter)"));
      return out;
    }
  }
  if (is_instance(p, root, "torch._tensor", "_rebuild_from_type_v2")) {
    const auto& a = p.at(p.at(root).args).items;
    // A plain torch.Tensor with Python attributes (FSDP1's state_dict tensors carry
    // _has_been_cloned): (func=_rebuild_tensor_v2/_v3, type=torch.Tensor, args, state); the
    // attributes are not the tensor's data.
    if (a.size() >= 3 && p.is_global(a[1], "torch", "Tensor")) {
      const bool v2 = p.is_global(a[0], "torch._utils", "_rebuild_tensor_v2");
      const bool v3 = p.is_global(a[0], "torch._utils", "_rebuild_tensor_v3");
      if (v2 || v3) {
        out.kind = Payload::Kind::kTensor;
        OPTSTATE_ASSIGN_OR_RETURN(out.tensor, tensor_args(p, v3, a[2], where));
        return out;
      }
    }
    // torchao's float8 training keeps each weight in a wrapper subclass that FSDP2's all-gather
    // casts to float8 (torchao.float8's WeightWithDynamicFloat8CastTensor, and the Delayed and
    // Static ones before): (_rebuild_wrapper_subclass, cls, (cls, dtype, size, ...), {"_tensor":
    // the weight in its own dtype, ...}). Its data is that tensor, of the dtype and size claimed.
    if (a.size() >= 4 && p.is_global(a[0], "torch._utils", "_rebuild_wrapper_subclass") && is_float8_weight_wrapper(p, a[1])) {
      const std::string fw = where + " (torchao's float8 training weight)";
      const Ref inner = p.dict_get(a[3], "_tensor");
      if (!is_tensor_rebuild(p, inner)) return corrupt(fw + ": without its '_tensor'");
      out.kind = Payload::Kind::kTensor;
      OPTSTATE_ASSIGN_OR_RETURN(out.tensor, tensor_ref(p, inner, fw));
      const auto& sub = p.at(a[2]);
      const auto claimed_shape = sub.kind == Kind::kTuple && sub.items.size() >= 3 ? int_tuple(p, sub.items[2]) : std::nullopt;
      const auto claimed_dtype = sub.kind == Kind::kTuple && sub.items.size() >= 3 ? torch_dtype(p, sub.items[1]) : std::nullopt;
      if (!claimed_shape || !claimed_dtype || *claimed_shape != out.tensor.shape || *claimed_dtype != out.tensor.dtype)
        return corrupt(fw + ": its '_tensor' is not of the dtype and size the subclass claims");
      return out;
    }
    // (func=_rebuild_wrapper_subclass, type=OptimState8bit, args=(cls, dtype, size, stride, ...), state);
    // OptimStateFp8 the same without a qmap (codes float8_e4m3fn).
    std::string_view package, cls;  // which subclass, and the package that defined it
    if (a.size() >= 2)
      for (const auto& [module, name] : {std::pair{"subclass_8bit", "OptimState8bit"}, std::pair{"subclass_fp8", "OptimStateFp8"},
                                         std::pair{"subclass_4bit", "OptimState4bit"}})
        if (package.empty() && !(package = torchao_subclass_package(p, a[1], module, name)).empty()) cls = name;
    const bool fp8 = cls == "OptimStateFp8", four = cls == "OptimState4bit";
    if (a.size() < 4 || !p.is_global(a[0], "torch._utils", "_rebuild_wrapper_subclass") || package.empty())
      return corrupt(fmt::format("{}: a tensor subclass other than torchao's OptimState8bit, OptimState4bit and "
                                 "OptimStateFp8", where));
    const char* name = fp8 ? "OptimStateFp8" : four ? "OptimState4bit" : "OptimState8bit";
    const auto& sub = p.at(a[2]);
    if (sub.kind == Kind::kTuple && sub.items.size() >= 3) {
      auto shape = int_tuple(p, sub.items[2]);
      if (shape) out.claimed_shape = *shape;
      out.claimed_dtype = torch_dtype(p, sub.items[1]);
    }
    const Ref st = a[3];
    const Ref codes = p.dict_get(st, "codes"), scale = p.dict_get(st, "scale"), qmap = p.dict_get(st, "qmap");
    if (codes == kNoRef || scale == kNoRef || (qmap == kNoRef && !fp8))
      return corrupt(fmt::format("{}: {} without codes, scale{}", where, name, fp8 ? "" : " and qmap"));
    out.kind = Payload::Kind::kOptimState8bit;
    out.torchao_package = package;
    out.fp8 = fp8;
    out.bits = four ? 4 : 8;
    OPTSTATE_ASSIGN_OR_RETURN(out.codes, tensor_ref(p, codes, where + " codes", fp8));
    OPTSTATE_ASSIGN_OR_RETURN(out.scale, tensor_ref(p, scale, where + " scale"));
    if (!fp8) {
      OPTSTATE_ASSIGN_OR_RETURN(out.qmap, tensor_ref(p, qmap, where + " qmap"));
    }
    OPTSTATE_RETURN_IF_ERROR(require_contiguous(out.codes, where + " codes"));
    OPTSTATE_RETURN_IF_ERROR(require_contiguous(out.scale, where + " scale"));
    OPTSTATE_RETURN_IF_ERROR(require_contiguous(out.qmap, where + " qmap"));
    if (out.codes.dtype != DType::kU8 || out.scale.dtype != DType::kF32 || (!fp8 && out.qmap.dtype != DType::kF32))
      return corrupt(fmt::format("{}: {} with codes/scale{} not {}/f32{}", where, name, fp8 ? "" : "/qmap",
                                 fp8 ? "float8_e4m3fn" : "u8", fp8 ? "" : "/f32"));
    if (four && *checked_numel(out.qmap.shape) != 16)
      return corrupt(fmt::format("{}: OptimState4bit with a map of {} values, not 16", where, *checked_numel(out.qmap.shape)));
    return out;
  }
  out.kind = Payload::Kind::kValue;
  return out;
}

void encode_tensor(pickle::Writer& w, DType d, const std::vector<int64_t>& shape, std::string_view storage_key) {
  int64_t numel = 1;
  for (int64_t x : shape) numel *= x;
  std::vector<int64_t> stride(shape.size(), 1);
  for (size_t k = shape.size(); k-- > 1;) stride[k - 1] = stride[k] * shape[k];
  encode_tensor_view(w, d, shape, stride, 0, numel, storage_key);
}

void encode_tensor_view(pickle::Writer& w, DType d, const std::vector<int64_t>& shape,
                        const std::vector<int64_t>& stride, int64_t offset, int64_t storage_numel,
                        std::string_view storage_key) {
  auto int_tuple_of = [&w](const std::vector<int64_t>& v) {
    w.mark();
    for (int64_t x : v) w.integer(x);
    w.tuple_from_mark();
  };
  // A dtype with a typed storage class is pickled as torch does (_rebuild_tensor_v2, the storage's
  // size in elements); one without (float8, uint16..64) as torch does those: _rebuild_tensor_v3, an
  // UntypedStorage sized in bytes, the dtype last. The offset counts elements either way.
  const auto& info = dtype_info(d);
  const bool untyped = info.torch_storage.empty();
  w.global("torch._utils", untyped ? "_rebuild_tensor_v3" : "_rebuild_tensor_v2");
  w.mark();
  w.mark();
  w.str("storage");
  if (untyped)
    w.global("torch.storage", "UntypedStorage");
  else
    w.global("torch", info.torch_storage);
  w.str(storage_key);
  w.str("cpu");
  w.integer(untyped ? storage_numel * info.size : storage_numel);
  w.tuple_from_mark();
  w.binpersid();
  w.integer(offset);
  int_tuple_of(shape);
  int_tuple_of(stride);
  w.boolean(false);
  w.global("collections", "OrderedDict");
  w.empty_tuple();
  w.reduce();
  if (untyped) w.global("torch", info.torch_name);
  w.tuple_from_mark();
  w.reduce();
}

}  // namespace optstate::dcp
