#include "archive.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cmath>
#include <tuple>

#include "torch_bridge.h"

namespace optstate::optim {

namespace {

// The archive layout's version string: torch::optim's loader asserts exactly this.
constexpr const char* kArchiveVersion = "1.5.0";
constexpr const char* kMoments[] = {kExpAvg, kExpAvgSq, kMaxExpAvgSq};

std::string param_key(const at::Tensor& p) {
  return std::to_string(reinterpret_cast<size_t>(p.unsafeGetTensorImpl()));
}

at::Tensor tensor_from(const Buffer& b, DType dtype, const std::vector<int64_t>& shape) {
  auto t = tensor_of(b, dtype, shape);
  TORCH_CHECK(t.ok(), "optimizer archive: ", t.status().message());
  return *t;
}

}  // namespace

std::vector<std::string> numbered_names(const torch::optim::Optimizer& opt) {
  std::vector<std::string> names;
  for (const auto& g : opt.param_groups())
    for (size_t i = 0; i < g.params().size(); ++i) names.push_back(std::to_string(names.size()));
  return names;
}

void write_archive(torch::serialize::OutputArchive& archive, const torch::optim::Optimizer& opt,
                   const OptimizerState& state, const std::vector<std::pair<std::string, int64_t>>& extra_options) {
  archive.write("pytorch_version", c10::IValue(kArchiveVersion));
  torch::serialize::OutputArchive states(archive.compilation_unit());
  torch::serialize::OutputArchive groups(archive.compilation_unit());
  groups.write("param_groups/size", at::tensor(static_cast<int64_t>(opt.param_groups().size())));
  size_t index = 0;
  for (size_t gi = 0; gi < opt.param_groups().size(); ++gi) {
    const auto& params = opt.param_groups()[gi].params();
    torch::serialize::OutputArchive group(archive.compilation_unit());
    group.write("params/size", at::tensor(static_cast<int64_t>(params.size())));
    for (size_t j = 0; j < params.size(); ++j) {
      const std::string key = param_key(params[j]);
      group.write("params/" + std::to_string(j), c10::IValue(key));
      const ParamState& ps = state.params.at(std::to_string(index++));
      if (ps.entries.empty()) continue;  // never stepped: no state, as torch::optim keeps it
      torch::serialize::OutputArchive one(archive.compilation_unit());
      one.write("step", c10::IValue(ps.step));
      for (const char* moment : kMoments) {
        auto it = ps.entries.find(moment);
        if (it == ps.entries.end()) continue;
        const Entry& e = it->second;
        if (e.encoding == Encoding::kDense) {
          one.write(moment, c10::IValue(tensor_from(e.values, e.dtype, ps.shape)));
          continue;
        }
        const auto numel = checked_numel(ps.shape);
        TORCH_CHECK(numel.ok(), "optimizer archive: ", numel.status().message());
        one.write(std::string(moment) + "_codes", c10::IValue(tensor_from(e.codes, DType::kU8, ps.shape)));
        one.write(std::string(moment) + "_absmax",
                  c10::IValue(tensor_from(e.absmax, DType::kF32, {component_count(e, Component::kAbsmax, *numel)})));
        one.write("block_size", c10::IValue(e.block_size));
      }
      states.write(key, one);
    }
    const Hyperparameters& h = state.groups.at(gi).hyper;
    torch::serialize::OutputArchive options(archive.compilation_unit());
    // What torch::optim::AdamWOptions reads (it needs every one of these), then ours.
    options.write("lr", c10::IValue(h.lr));
    options.write("betas", c10::IValue(std::make_tuple(h.beta1, h.beta2)));
    options.write("eps", c10::IValue(h.eps));
    options.write("weight_decay", c10::IValue(h.weight_decay));
    options.write("amsgrad", c10::IValue(h.amsgrad));
    options.write("maximize", c10::IValue(h.maximize));
    for (const auto& [name, value] : extra_options) options.write(name, c10::IValue(value));
    group.write("options", options);
    groups.write("param_groups/" + std::to_string(gi), group);
  }
  archive.write("state", states);
  archive.write("param_groups", groups);
}

namespace {

// A count the archive stores as a one-element integer tensor ("param_groups/size").
Result<int64_t> read_count(torch::serialize::InputArchive& a, const std::string& key, const std::string& where) {
  at::Tensor t;
  if (!a.try_read(key, t) || !t.defined())
    return corrupt(fmt::format("{}: no '{}'", where, key));
  if (t.numel() != 1 || at::isFloatingType(t.scalar_type()) || t.scalar_type() == at::kBool)
    return corrupt(fmt::format("{}: '{}' is not an integer", where, key));
  const int64_t n = t.item<int64_t>();
  if (n < 0 || n > (int64_t{1} << 24)) return corrupt(fmt::format("{}: '{}' is {}", where, key, n));
  return n;
}

Result<double> read_double(torch::serialize::InputArchive& a, const char* key, const std::string& where) {
  c10::IValue v;
  if (!a.try_read(key, v)) return corrupt(fmt::format("{}: no '{}'", where, key));
  if (!v.isDouble() && !v.isInt()) return corrupt(fmt::format("{}: '{}' is not a number", where, key));
  const double d = v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
  if (!std::isfinite(d) || d < 0) return corrupt(fmt::format("{}: '{}' is {}", where, key, d));
  return d;
}

Result<bool> read_bool(torch::serialize::InputArchive& a, const char* key, const std::string& where,
                       std::optional<bool> otherwise) {
  c10::IValue v;
  if (!a.try_read(key, v)) {
    if (otherwise) return *otherwise;
    return corrupt(fmt::format("{}: no '{}'", where, key));
  }
  if (!v.isBool()) return corrupt(fmt::format("{}: '{}' is not a bool", where, key));
  return v.toBool();
}

Result<Hyperparameters> read_options(torch::serialize::InputArchive& group, const std::string& where) {
  torch::serialize::InputArchive o;
  if (!group.try_read("options", o)) return corrupt(fmt::format("{}: no 'options'", where));
  Hyperparameters h;
  OPTSTATE_ASSIGN_OR_RETURN(h.lr, read_double(o, "lr", where));
  OPTSTATE_ASSIGN_OR_RETURN(h.eps, read_double(o, "eps", where));
  OPTSTATE_ASSIGN_OR_RETURN(h.weight_decay, read_double(o, "weight_decay", where));
  OPTSTATE_ASSIGN_OR_RETURN(h.amsgrad, read_bool(o, "amsgrad", where, std::nullopt));
  OPTSTATE_ASSIGN_OR_RETURN(h.maximize, read_bool(o, "maximize", where, false));  // torch::optim has none
  c10::IValue betas;
  if (!o.try_read("betas", betas)) return corrupt(fmt::format("{}: no 'betas'", where));
  if (!betas.isTuple() || betas.toTupleRef().elements().size() != 2)
    return corrupt(fmt::format("{}: 'betas' is not a pair", where));
  double b[2];
  for (int i = 0; i < 2; ++i) {
    const c10::IValue& x = betas.toTupleRef().elements()[static_cast<size_t>(i)];
    if (!x.isDouble()) return corrupt(fmt::format("{}: 'betas' is not a pair of numbers", where));
    b[i] = x.toDouble();
    if (!(b[i] >= 0 && b[i] < 1)) return corrupt(fmt::format("{}: beta{} is {}", where, i + 1, b[i]));
  }
  h.beta1 = b[0];
  h.beta2 = b[1];
  return h;
}

// The step torch::optim writes as an int (a float32 0-d tensor is taken as well: exact integers only).
Result<int64_t> read_step(torch::serialize::InputArchive& a, const std::string& where) {
  c10::IValue v;
  if (!a.try_read("step", v)) return corrupt(fmt::format("{}: no 'step'", where));
  double d = -1;
  if (v.isInt()) {
    d = static_cast<double>(v.toInt());
  } else if (v.isTensor() && v.toTensor().numel() == 1) {
    d = v.toTensor().to(at::kDouble).item<double>();
  } else {
    return corrupt(fmt::format("{}: 'step' is not a number", where));
  }
  if (!(d >= 0 && d <= 9.007199254740992e15) || d != std::floor(d))
    return corrupt(fmt::format("{}: 'step' is {}", where, d));
  return static_cast<int64_t>(d);
}

Result<at::Tensor> read_tensor(torch::serialize::InputArchive& a, const std::string& key, const std::string& where,
                               bool required) {
  c10::IValue v;
  if (!a.try_read(key, v)) {
    if (required) return corrupt(fmt::format("{}: no '{}'", where, key));
    return at::Tensor();
  }
  if (!v.isTensor() || !v.toTensor().defined()) return corrupt(fmt::format("{}: '{}' is not a tensor", where, key));
  return v.toTensor().detach().to(at::kCPU).contiguous();
}

// One moment of one param: dense (`<m>`, any floating dtype, made fp32) or 8-bit (`<m>_codes`,
// `<m>_absmax`, the state's block_size). Absent: nullopt.
Result<std::optional<Entry>> read_moment(torch::serialize::InputArchive& a, const char* moment,
                                         const std::vector<int64_t>& shape, const std::string& where) {
  const std::string ew = fmt::format("{}, entry '{}'", where, moment);
  OPTSTATE_ASSIGN_OR_RETURN(at::Tensor dense, read_tensor(a, moment, ew, false));
  OPTSTATE_ASSIGN_OR_RETURN(at::Tensor codes, read_tensor(a, std::string(moment) + "_codes", ew, false));
  if (!dense.defined() && !codes.defined()) return std::optional<Entry>();
  if (dense.defined() && codes.defined()) return corrupt(fmt::format("{}: both dense and 8-bit", ew));
  Entry e;
  if (dense.defined()) {
    if (!at::isFloatingType(dense.scalar_type()))
      return corrupt(fmt::format("{}: dtype {} is not floating point", ew, c10::toString(dense.scalar_type())));
    if (shape_of(dense) != shape)
      return invalid_argument(fmt::format("{}: shape {} differs from the param's {}", ew, format_shape(shape_of(dense)),
                                 format_shape(shape)));
    e.dtype = DType::kF32;
    e.values = buffer_of(dense.to(at::kFloat));  // bf16/fp16/fp64 state of torch::optim: exact or rounded once
    return std::optional<Entry>(std::move(e));
  }
  if (codes.scalar_type() != at::kByte || shape_of(codes) != shape)
    return invalid_argument(fmt::format("{}: codes are {} {}, not uint8 {} as the param", ew, c10::toString(codes.scalar_type()),
                               format_shape(shape_of(codes)), format_shape(shape)));
  OPTSTATE_ASSIGN_OR_RETURN(at::Tensor absmax, read_tensor(a, std::string(moment) + "_absmax", ew, true));
  if (absmax.scalar_type() != at::kFloat || absmax.dim() != 1)
    return corrupt(fmt::format("{}: absmax is not a 1-D float32 tensor", ew));
  c10::IValue block;
  if (!a.try_read("block_size", block) || !block.isInt() || block.toInt() <= 0)
    return corrupt(fmt::format("{}: 8-bit without a positive 'block_size'", ew));
  e.encoding = Encoding::kBlockwise8;
  e.dtype = DType::kU8;
  e.block_size = block.toInt();
  e.qmap = std::string(moment) == kExpAvg ? "dynamic-signed" : "dynamic-unsigned";
  e.codes = buffer_of(codes);
  e.absmax = buffer_of(absmax);
  return std::optional<Entry>(std::move(e));
}

}  // namespace

Result<OptimizerState> read_archive(torch::serialize::InputArchive& archive, const torch::optim::Optimizer& opt) {
  const std::string top = "optimizer archive";
  c10::IValue version;
  if (!archive.try_read("pytorch_version", version))
    return corrupt(top + ": no 'pytorch_version' (not what torch::save writes for an optimizer)");
  if (!version.isString() || version.toStringRef() != kArchiveVersion)
    return unsupported(fmt::format("{}: pytorch_version {} (known: {})", top, version.isString() ? version.toStringRef() : "?",
                                   kArchiveVersion));
  torch::serialize::InputArchive states, groups;
  if (!archive.try_read("state", states)) return corrupt(top + ": no 'state'");
  if (!archive.try_read("param_groups", groups)) return corrupt(top + ": no 'param_groups'");
  OPTSTATE_ASSIGN_OR_RETURN(const int64_t group_count, read_count(groups, "param_groups/size", top));
  if (static_cast<size_t>(group_count) != opt.param_groups().size())
    return invalid_argument(fmt::format("{} has {} param groups; the optimizer has {}", top, group_count,
                                        opt.param_groups().size()));
  OptimizerState out;
  size_t index = 0;
  for (size_t gi = 0; gi < opt.param_groups().size(); ++gi) {
    const std::string gw = fmt::format("{}, param group {}", top, gi);
    torch::serialize::InputArchive group;
    if (!groups.try_read("param_groups/" + std::to_string(gi), group)) return corrupt(gw + ": missing");
    const auto& params = opt.param_groups()[gi].params();
    OPTSTATE_ASSIGN_OR_RETURN(const int64_t size, read_count(group, "params/size", gw));
    if (static_cast<size_t>(size) != params.size())
      return invalid_argument(fmt::format("{} has {} params; the optimizer's has {}", gw, size, params.size()));
    ParamGroup pg;
    OPTSTATE_ASSIGN_OR_RETURN(pg.hyper, read_options(group, gw));
    for (size_t j = 0; j < params.size(); ++j) {
      const std::string name = std::to_string(index++);
      const std::string pw = fmt::format("{}, param {} (#{})", gw, j, name);
      c10::IValue key;
      if (!group.try_read("params/" + std::to_string(j), key) || !key.isString())
        return corrupt(pw + ": no key");
      ParamState ps;
      ps.group = static_cast<int>(gi);
      ps.shape = shape_of(params[j]);
      OPTSTATE_ASSIGN_OR_RETURN(ps.param_dtype, dtype_of(params[j].scalar_type()));
      torch::serialize::InputArchive one;
      if (states.try_read(key.toStringRef(), one)) {
        OPTSTATE_ASSIGN_OR_RETURN(ps.step, read_step(one, pw));
        for (const char* moment : kMoments) {
          OPTSTATE_ASSIGN_OR_RETURN(auto e, read_moment(one, moment, ps.shape, pw));
          if (e) ps.entries.emplace(moment, std::move(*e));
        }
        if (!ps.entries.count(kExpAvg) || !ps.entries.count(kExpAvgSq))
          return corrupt(pw + ": state without exp_avg and exp_avg_sq");
      }
      pg.params.push_back(name);
      out.params.emplace(name, std::move(ps));
    }
    out.groups.push_back(std::move(pg));
  }
  for (const auto& [name, ps] : out.params)
    for (const auto& [entry, e] : ps.entries)
      if (e.encoding == Encoding::kBlockwise8) out.kind = "adamw8bit";
  OPTSTATE_RETURN_IF_ERROR(check_structure(out, true).with_context(top));
  return out;
}

}  // namespace optstate::optim
