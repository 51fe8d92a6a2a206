#include "torch_bridge.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstring>
#include <optional>

#include "adamw8bit.h"
#include "fused_adamw.h"
#include "optstate/transform.h"

namespace optstate::optim {

Result<DType> dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kF32;
    case at::kBFloat16: return DType::kBF16;
    case at::kHalf: return DType::kF16;
    case at::kDouble: return DType::kF64;
    case at::kByte: return DType::kU8;
    case at::kChar: return DType::kI8;
    case at::kInt: return DType::kI32;
    case at::kLong: return DType::kI64;
    case at::kShort: return DType::kI16;
    case at::kBool: return DType::kBool;
    case at::kComplexFloat: return DType::kC64;
    case at::kComplexDouble: return DType::kC128;
    case at::kFloat8_e4m3fn: return DType::kF8E4M3FN;
    case at::kFloat8_e5m2: return DType::kF8E5M2;
    case at::kFloat8_e4m3fnuz: return DType::kF8E4M3FNUZ;
    case at::kFloat8_e5m2fnuz: return DType::kF8E5M2FNUZ;
    case at::kFloat8_e8m0fnu: return DType::kF8E8M0FNU;
    case at::kUInt16: return DType::kU16;
    case at::kUInt32: return DType::kU32;
    case at::kUInt64: return DType::kU64;
    case at::kFloat4_e2m1fn_x2: return DType::kF4E2M1FNX2;
    default: return unsupported(fmt::format("dtype {} has no optstate equivalent", c10::toString(t)));
  }
}

at::ScalarType scalar_type_of(DType d) {
  switch (d) {
    case DType::kF32: return at::kFloat;
    case DType::kBF16: return at::kBFloat16;
    case DType::kF16: return at::kHalf;
    case DType::kF64: return at::kDouble;
    case DType::kU8: return at::kByte;
    case DType::kI8: return at::kChar;
    case DType::kI32: return at::kInt;
    case DType::kI64: return at::kLong;
    case DType::kI16: return at::kShort;
    case DType::kBool: return at::kBool;
    case DType::kC64: return at::kComplexFloat;
    case DType::kC128: return at::kComplexDouble;
    case DType::kF8E4M3FN: return at::kFloat8_e4m3fn;
    case DType::kF8E5M2: return at::kFloat8_e5m2;
    case DType::kF8E4M3FNUZ: return at::kFloat8_e4m3fnuz;
    case DType::kF8E5M2FNUZ: return at::kFloat8_e5m2fnuz;
    case DType::kF8E8M0FNU: return at::kFloat8_e8m0fnu;
    case DType::kU16: return at::kUInt16;
    case DType::kU32: return at::kUInt32;
    case DType::kU64: return at::kUInt64;
    case DType::kF4E2M1FNX2: return at::kFloat4_e2m1fn_x2;
  }
  return at::kFloat;
}

std::vector<int64_t> shape_of(const at::Tensor& t) { return {t.sizes().begin(), t.sizes().end()}; }

Buffer buffer_of(const at::Tensor& t) {
  at::Tensor c = t.detach().to(at::kCPU).contiguous();
  Buffer b;
  b.data = static_cast<const std::byte*>(c.const_data_ptr());
  b.size = static_cast<size_t>(c.nbytes());
  b.owner = std::make_shared<at::Tensor>(std::move(c));
  return b;
}

Result<at::Tensor> tensor_of(const Buffer& b, DType dtype, const std::vector<int64_t>& shape) {
  OPTSTATE_ASSIGN_OR_RETURN(int64_t numel, checked_numel(shape));
  if (static_cast<int64_t>(b.size) != numel * dtype_size(dtype))
    return invalid_argument(fmt::format("{} bytes cannot hold a {} tensor of shape {}", b.size, dtype_name(dtype),
                                        format_shape(shape)));
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(scalar_type_of(dtype)));
  if (b.size) std::memcpy(t.data_ptr(), b.data, b.size);
  return t;
}

Result<at::Tensor> tensor_taking(Buffer b, DType dtype, const std::vector<int64_t>& shape) {
  OPTSTATE_ASSIGN_OR_RETURN(int64_t numel, checked_numel(shape));
  if (static_cast<int64_t>(b.size) != numel * dtype_size(dtype))
    return invalid_argument(fmt::format("{} bytes cannot hold a {} tensor of shape {}", b.size, dtype_name(dtype),
                                        format_shape(shape)));
  const size_t align = alignof(std::max_align_t) < 16 ? alignof(std::max_align_t) : 16;
  if (!b.owner || b.size == 0 || reinterpret_cast<uintptr_t>(b.data) % align != 0) return tensor_of(b, dtype, shape);
  auto* data = const_cast<std::byte*>(b.data);
  auto owner = std::make_shared<std::shared_ptr<const void>>(std::move(b.owner));
  return at::from_blob(
      data, shape, [owner](void*) mutable { owner.reset(); }, at::TensorOptions().dtype(scalar_type_of(dtype)));
}

namespace {

Hyperparameters hyper_of(const FusedAdamWOptions& o) {
  return {lr_value({o.lr(), o.lr_tensor()}), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(), o.weight_decay(), o.amsgrad(),
          o.maximize()};
}

Entry dense_entry(const at::Tensor& t, DType d) {
  Entry e;
  e.encoding = Encoding::kDense;
  e.dtype = d;
  e.values = buffer_of(t);
  return e;
}

size_t param_count(const torch::optim::Optimizer& opt) {
  size_t n = 0;
  for (const auto& g : opt.param_groups()) n += g.params().size();
  return n;
}

// The export both optimizers share: groups with their hyperparameters, one ParamState per named
// param with shape, dtype, group and (with include_params) the weights. `fill` adds the step and
// moments from the optimizer's own per-param state, when it has one.
template <typename Opt, typename HyperOf, typename Fill>
Result<OptimizerState> export_common(const Opt& opt, const std::vector<std::string>& names, const char* kind,
                                     bool include_params, HyperOf hyper_of, Fill fill) {
  if (names.size() != param_count(opt))
    return invalid_argument(
        fmt::format("{} names given for an optimizer with {} params", names.size(), param_count(opt)));
  OptimizerState out;
  out.kind = kind;
  size_t i = 0;
  for (size_t gi = 0; gi < opt.param_groups().size(); ++gi) {
    const auto& group = opt.param_groups()[gi];
    ParamGroup pg;
    pg.hyper = hyper_of(group.options());
    for (const auto& p : group.params()) {
      const std::string& fqn = names[i++];
      if (out.params.count(fqn)) return invalid_argument(fmt::format("param name '{}' given twice", fqn));
      ParamState ps;
      ps.shape = shape_of(p);
      OPTSTATE_ASSIGN_OR_RETURN(ps.param_dtype, dtype_of(p.scalar_type()));
      ps.group = static_cast<int>(gi);
      auto it = opt.state().find(p.unsafeGetTensorImpl());
      if (it != opt.state().end()) {
        fill(*it->second, ps);
        ps.step = opt.step_count(p);  // a CUDA param's device counter: ahead after graph replays
      }
      if (include_params) ps.entries.emplace(kParam, dense_entry(p, ps.param_dtype));
      pg.params.push_back(fqn);
      out.params.emplace(fqn, std::move(ps));
    }
    out.groups.push_back(std::move(pg));
  }
  return out;
}

// One param's part of an import, built before anything live changes: an import applies whole or
// not at all (a failure leaves the optimizer and the weights as they were).
struct PendingParam {
  at::Tensor param;
  at::Tensor weights;                                        // defined: copied into param
  std::unique_ptr<torch::optim::OptimizerParamState> state;  // null: the param has no state
};

void apply_import(torch::optim::Optimizer& opt, std::vector<PendingParam>& pending) {
  at::NoGradGuard no_grad;
  for (PendingParam& pp : pending) {
    if (pp.weights.defined()) pp.param.copy_(pp.weights);
    void* key = pp.param.unsafeGetTensorImpl();
    if (pp.state)
      opt.state()[key] = std::move(pp.state);
    else
      opt.state().erase(key);
  }
}

// The checks an import makes before it changes anything, and the checkpoint's hyperparameters for
// each live param group (nullopt: a group without params). Groups are matched through their params,
// not by position: a flattened DCP (torchtitan's) records no group order, and the canonical state
// merges groups with equal hyperparameters. A live group whose params the checkpoint has with
// different hyperparameters is refused.
Result<std::vector<std::optional<Hyperparameters>>> check_import(const torch::optim::Optimizer& opt,
                                                                 const std::vector<std::string>& names,
                                                                 const OptimizerState& state, bool load_params) {
  if (names.size() != param_count(opt))
    return invalid_argument(
        fmt::format("{} names given for an optimizer with {} params", names.size(), param_count(opt)));
  std::vector<std::optional<Hyperparameters>> hypers(opt.param_groups().size());
  size_t i = 0;
  for (size_t gi = 0; gi < opt.param_groups().size(); ++gi) {
    std::string first;
    for (const auto& p : opt.param_groups()[gi].params()) {
      const std::string& fqn = names[i++];
      auto it = state.params.find(fqn);
      if (it == state.params.end()) return not_found(fmt::format("checkpoint has no state for param '{}'", fqn));
      const ParamState& ps = it->second;
      if (ps.shape != shape_of(p))
        return invalid_argument(fmt::format("param '{}': checkpoint shape {} differs from the model's {}", fqn,
                                            format_shape(ps.shape), format_shape(shape_of(p))));
      if (ps.group < 0 || static_cast<size_t>(ps.group) >= state.groups.size())
        return invalid_argument(fmt::format("param '{}' names param group {} of {}", fqn, ps.group, state.groups.size()));
      const Hyperparameters& h = state.groups[static_cast<size_t>(ps.group)].hyper;
      if (!hypers[gi]) {
        hypers[gi] = h;
        first = fqn;
      } else if (!(*hypers[gi] == h)) {
        return invalid_argument(fmt::format("param group {} holds '{}' and '{}', which the checkpoint has with "
                                            "different hyperparameters; split the group as it was",
                                            gi, first, fqn));
      }
      if (ps.entries.count(kExpAvg) != ps.entries.count(kExpAvgSq))
        return invalid_argument(fmt::format("param '{}' has only one of exp_avg and exp_avg_sq", fqn));
      for (const auto& [name, e] : ps.entries)
        if (name != kParam && e.encoding == Encoding::kDense && e.dtype != DType::kF32)
          return invalid_argument(fmt::format("entry '{}' is {}; optstate optimizers keep fp32 state",
                                              entry_key(fqn, name), dtype_name(e.dtype)));
      if (load_params && !ps.entries.count(kParam))
        return not_found(fmt::format("checkpoint has no weights for param '{}'", fqn));
    }
  }
  return hypers;
}

}  // namespace

Result<OptimizerState> export_state(const FusedAdamW& opt, const std::vector<std::string>& names,
                                    bool include_params) {
  return export_common(
      opt, names, "adamw", include_params,
      [](const torch::optim::OptimizerOptions& o) { return hyper_of(static_cast<const FusedAdamWOptions&>(o)); },
      [](const torch::optim::OptimizerParamState& base, ParamState& ps) {
        const auto& st = static_cast<const FusedAdamWParamState&>(base);
        ps.step = st.step();
        ps.entries.emplace(kExpAvg, dense_entry(st.exp_avg(), DType::kF32));
        ps.entries.emplace(kExpAvgSq, dense_entry(st.exp_avg_sq(), DType::kF32));
        if (st.max_exp_avg_sq().defined())
          ps.entries.emplace(kMaxExpAvgSq, dense_entry(st.max_exp_avg_sq(), DType::kF32));
      });
}

Status import_state(FusedAdamW& opt, const std::vector<std::string>& names, const OptimizerState& state_in,
                    bool load_params) {
  // FusedAdamW keeps dense fp32 moments: 8-bit ones are dequantized.
  OPTSTATE_ASSIGN_OR_RETURN(const OptimizerState state, dequantize_state(state_in));
  OPTSTATE_ASSIGN_OR_RETURN(const auto hypers, check_import(opt, names, state, load_params));
  std::vector<PendingParam> pending;
  size_t i = 0;
  for (auto& group : opt.param_groups())
    for (auto& p : group.params()) {
      const ParamState& ps = state.params.at(names[i++]);
      auto load = [&](const char* name) -> Result<at::Tensor> {
        const Entry& e = ps.entries.at(name);
        return tensor_of(e.values, e.dtype, ps.shape);
      };
      PendingParam& pp = pending.emplace_back();
      pp.param = p;
      if (load_params) {
        OPTSTATE_ASSIGN_OR_RETURN(pp.weights, load(kParam));
      }
      if (!ps.entries.count(kExpAvg)) continue;
      auto st = std::make_unique<FusedAdamWParamState>();
      st->step(ps.step);
      OPTSTATE_ASSIGN_OR_RETURN(at::Tensor m, load(kExpAvg));
      OPTSTATE_ASSIGN_OR_RETURN(at::Tensor v, load(kExpAvgSq));
      // The state lives on its param's device and in its layout (channels_last), as a step makes it.
      auto placed = [&p](const at::Tensor& t) {
        return p.is_contiguous() ? t.to(p.device()) : at::empty_like(p, p.options().dtype(t.scalar_type())).copy_(t);
      };
      st->exp_avg(placed(m));
      st->exp_avg_sq(placed(v));
      if (ps.entries.count(kMaxExpAvgSq)) {
        OPTSTATE_ASSIGN_OR_RETURN(at::Tensor mx, load(kMaxExpAvgSq));
        st->max_exp_avg_sq(placed(mx));
      }
      pp.state = std::move(st);
    }
  for (size_t gi = 0; gi < opt.param_groups().size(); ++gi) {
    if (!hypers[gi]) continue;
    auto& o = static_cast<FusedAdamWOptions&>(opt.param_groups()[gi].options());
    const Hyperparameters& h = *hypers[gi];
    o.set_lr(h.lr);  // and into lr_tensor, in place
    o.betas({h.beta1, h.beta2}).eps(h.eps).weight_decay(h.weight_decay).amsgrad(h.amsgrad).maximize(h.maximize);
  }
  apply_import(opt, pending);
  return Status::Ok();
}

namespace {

Entry blockwise_entry(const Moment8bit& m, int64_t block, const char* qmap) {
  Entry e;
  e.encoding = Encoding::kBlockwise8;
  e.dtype = DType::kU8;
  e.block_size = block;
  e.qmap = qmap;
  e.codes = buffer_of(m.codes);
  e.absmax = buffer_of(m.absmax);
  return e;
}

// One moment on `device` (its param's, as a step makes it).
Result<Moment8bit> moment_of(const Entry& e, const std::vector<int64_t>& shape, const at::Device& device) {
  Moment8bit m;
  if (e.encoding == Encoding::kDense) {
    OPTSTATE_ASSIGN_OR_RETURN(m.values, tensor_of(e.values, DType::kF32, shape));
    m.values = m.values.to(device);
    return m;
  }
  OPTSTATE_ASSIGN_OR_RETURN(int64_t numel, checked_numel(shape));
  OPTSTATE_ASSIGN_OR_RETURN(m.codes, tensor_of(e.codes, DType::kU8, shape));
  OPTSTATE_ASSIGN_OR_RETURN(m.absmax,
                            tensor_of(e.absmax, DType::kF32, {component_count(e, Component::kAbsmax, numel)}));
  m.codes = m.codes.to(device);
  m.absmax = m.absmax.to(device);
  return m;
}

}  // namespace

Result<OptimizerState> export_state(const AdamW8bit& opt, const std::vector<std::string>& names,
                                    bool include_params) {
  return export_common(
      opt, names, "adamw8bit", include_params,
      [](const torch::optim::OptimizerOptions& base) {
        const auto& o = static_cast<const AdamW8bitOptions&>(base);
        return Hyperparameters{lr_value({o.lr(), o.lr_tensor()}), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(), o.weight_decay(),
                               o.amsgrad(), false};
      },
      [](const torch::optim::OptimizerParamState& base, ParamState& ps) {
        const auto& st = static_cast<const AdamW8bitParamState&>(base);
        ps.step = st.step();
        const std::pair<const char*, const Moment8bit*> moments[] = {
            {kExpAvg, &st.exp_avg()}, {kExpAvgSq, &st.exp_avg_sq()}, {kMaxExpAvgSq, &st.max_exp_avg_sq()}};
        for (const auto& [name, m] : moments) {
          if (!m->defined()) continue;
          if (st.block_size() > 0)
            ps.entries.emplace(name, blockwise_entry(*m, st.block_size(),
                                                     name == std::string(kExpAvg) ? "dynamic-signed"
                                                                                  : "dynamic-unsigned"));
          else
            ps.entries.emplace(name, dense_entry(m->values, DType::kF32));
        }
      });
}

Status import_state(AdamW8bit& opt, const std::vector<std::string>& names, const OptimizerState& state_in,
                    bool load_params) {
  const auto& o0 = static_cast<const AdamW8bitOptions&>(opt.param_groups().at(0).options());
  for (const auto& g : opt.param_groups()) {
    const auto& o = static_cast<const AdamW8bitOptions&>(g.options());
    if (o.block_size() != o0.block_size() || o.min_8bit_size() != o0.min_8bit_size())
      return invalid_argument("AdamW8bit param groups must share block_size and min_8bit_size to import state");
  }
  // Bring every moment to what this optimizer keeps: 8-bit at its block size for eligible params,
  // dense fp32 for the rest.
  OPTSTATE_ASSIGN_OR_RETURN(OptimizerState dense, dequantize_state(state_in));
  OPTSTATE_ASSIGN_OR_RETURN(const OptimizerState state,
                            quantize_state(dense, {o0.block_size(), o0.min_8bit_size()}));
  OPTSTATE_ASSIGN_OR_RETURN(const auto hypers, check_import(opt, names, state, load_params));
  std::vector<PendingParam> pending;
  size_t i = 0;
  for (auto& group : opt.param_groups())
    for (auto& p : group.params()) {
      const ParamState& ps = state.params.at(names[i++]);
      PendingParam& pp = pending.emplace_back();
      pp.param = p;
      if (load_params) {
        const Entry& w = ps.entries.at(kParam);
        OPTSTATE_ASSIGN_OR_RETURN(pp.weights, tensor_of(w.values, w.dtype, ps.shape));
      }
      if (!ps.entries.count(kExpAvg)) continue;
      auto st = std::make_unique<AdamW8bitParamState>();
      st->step(ps.step);
      st->block_size(ps.entries.at(kExpAvg).encoding == Encoding::kBlockwise8 ? o0.block_size() : 0);
      OPTSTATE_ASSIGN_OR_RETURN(Moment8bit m, moment_of(ps.entries.at(kExpAvg), ps.shape, p.device()));
      OPTSTATE_ASSIGN_OR_RETURN(Moment8bit v, moment_of(ps.entries.at(kExpAvgSq), ps.shape, p.device()));
      st->exp_avg(m);
      st->exp_avg_sq(v);
      if (ps.entries.count(kMaxExpAvgSq)) {
        OPTSTATE_ASSIGN_OR_RETURN(Moment8bit x, moment_of(ps.entries.at(kMaxExpAvgSq), ps.shape, p.device()));
        st->max_exp_avg_sq(x);
      }
      pp.state = std::move(st);
    }
  for (size_t gi = 0; gi < opt.param_groups().size(); ++gi) {
    if (!hypers[gi]) continue;
    auto& o = static_cast<AdamW8bitOptions&>(opt.param_groups()[gi].options());
    const Hyperparameters& h = *hypers[gi];
    o.set_lr(h.lr);  // and into lr_tensor, in place
    o.betas({h.beta1, h.beta2}).eps(h.eps).weight_decay(h.weight_decay).amsgrad(h.amsgrad);
  }
  apply_import(opt, pending);
  return Status::Ok();
}

}  // namespace optstate::optim
