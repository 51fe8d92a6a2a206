#include "torchao_layout.h"

#include <fmt/format.h>

#include <map>
#include <set>

#include "dcp/dcp_layout.h"
#include "optstate/quant8.h"
#include "optstate/transform.h"
#include "torchsave/torchsave_layout.h"

namespace optstate::torchao {

namespace {

// torchao keeps step as a float32 tensor: exact integers up to 2^24.
constexpr int64_t kMaxExactStep = int64_t{1} << 24;

const char* const kMoments[] = {kExpAvg, kExpAvgSq, kMaxExpAvgSq};

void int_tuple(pickle::Writer& w, const std::vector<int64_t>& v) {
  w.mark();
  for (int64_t x : v) w.integer(x);
  w.tuple_from_mark();
}

}  // namespace

bool steps_as_8bit(const std::string& moment, const Entry& e, int64_t numel) {
  return e.encoding == Encoding::kBlockwise8 && e.block_size >= 1 && numel > 0 && numel % e.block_size == 0 &&
         e.qmap == qmap_name(moment == kExpAvg ? QMap::kDynamicSigned : QMap::kDynamicUnsigned);
}

void encode_optim_state_8bit(pickle::Writer& w, const std::vector<int64_t>& shape, DType apparent, int64_t block_size,
                             bool is_signed, const std::string& codes_key, const std::string& scale_key,
                             const std::string& qmap_key, std::string_view package) {
  const std::string module = std::string(package) + ".subclass_8bit";
  int64_t numel = 1;
  for (int64_t x : shape) numel *= x;
  std::vector<int64_t> stride(shape.size(), 1);
  for (size_t k = shape.size(); k-- > 1;) stride[k - 1] = stride[k] * shape[k];
  w.global("torch._tensor", "_rebuild_from_type_v2");
  w.mark();
  w.global("torch._utils", "_rebuild_wrapper_subclass");
  w.global(module, "OptimState8bit");
  w.mark();  // the wrapper's args: (cls, dtype, size, stride, storage_offset, layout, device, requires_grad)
  w.global(module, "OptimState8bit");
  w.global("torch", dtype_info(apparent).torch_name);
  int_tuple(w, shape);
  int_tuple(w, stride);
  w.integer(0);
  w.global("torch.serialization", "_get_layout");
  w.mark();
  w.str("torch.strided");
  w.tuple_from_mark();
  w.reduce();
  w.global("torch", "device");
  w.mark();
  w.str("cpu");
  w.tuple_from_mark();
  w.reduce();
  w.boolean(false);
  w.tuple_from_mark();
  w.empty_dict();  // the subclass's __dict__: its tensors and attributes
  w.mark();
  w.str("codes");
  dcp::encode_tensor(w, DType::kU8, shape, codes_key);
  w.str("scale");
  dcp::encode_tensor(w, DType::kF32, {numel / block_size}, scale_key);
  w.str("qmap");
  dcp::encode_tensor(w, DType::kF32, {256}, qmap_key);
  w.str("signed");
  w.boolean(is_signed);
  w.str("block_size");
  w.integer(block_size);
  w.setitems_from_mark();
  w.tuple_from_mark();
  w.reduce();
}

Result<Plan> plan_state_dict(const OptimizerState& state, std::string_view package) {
  return torchsave::plan_of([&](pickle::Writer& w, const torchsave::SpecSink& add, const torchsave::FrameOptions& fo) {
    return plan_frame(state, w, add, fo, package);
  });
}

Status plan_frame(const OptimizerState& state, pickle::Writer& w, const torchsave::SpecSink& add,
                  const torchsave::FrameOptions& options, std::string_view package) {
  if (!dcp::is_torchao_package(package))
    return invalid_argument(fmt::format("torchao: '{}' defines no torchao optimizer state (torchao.optim, or "
                                        "torchao.prototype.low_bit_optim before torchao 0.11)", printable(package)));
  OPTSTATE_RETURN_IF_ERROR(check_structure(state, false));
  const std::vector<std::string> order = torchsave::param_order(state);
  if (order.size() != state.params.size() || std::set(order.begin(), order.end()).size() != order.size())
    return invalid_argument("torchao: every param must be in exactly one param group (torch numbers them by it)");
  for (size_t g = 0; g < state.groups.size(); ++g)
    if (state.groups[g].hyper.maximize)
      return invalid_argument(fmt::format("param group {}: maximize; torchao's AdamW has no maximize", g));
  for (const std::string& fqn : order) {
    const ParamState& ps = state.params.at(fqn);
    for (const auto& [name, e] : ps.entries)
      if (name != kParam && name != kExpAvg && name != kExpAvgSq && name != kMaxExpAvgSq)
        return invalid_argument(fmt::format("param '{}': entry '{}' has no place in torchao's AdamW state", fqn, name));
    if (ps.entries.count(kExpAvg) != ps.entries.count(kExpAvgSq))
      return invalid_argument(fmt::format("param '{}' has only one of exp_avg and exp_avg_sq", fqn));
    if (ps.entries.count(kMaxExpAvgSq) && !ps.entries.count(kExpAvg))
      return invalid_argument(fmt::format("param '{}': max_exp_avg_sq without exp_avg", fqn));
    if (ps.entries.count(kExpAvg) && (ps.step < 0 || ps.step > kMaxExactStep))
      return invalid_argument(fmt::format("param '{}': step {} is beyond what torchao's float32 step holds exactly "
                                          "(2^24)", fqn, ps.step));
    OPTSTATE_RETURN_IF_ERROR(checked_numel(ps.shape).status());
  }

  std::map<std::string, std::string> map_key;  // map name -> its one storage, shared by every moment
  auto qmap_storage = [&](const std::string& name) {
    auto it = map_key.find(name);
    if (it != map_key.end()) return it->second;
    return map_key[name] = add(StorageSpec::of_qmap(name));
  };
  torchsave::encode_state_dict_frame(state, w, {
      .weight = [&](size_t i, const ParamState& ps) {
        dcp::encode_tensor(w, ps.entries.at(kParam).dtype, ps.shape, add(StorageSpec::of_component(order[i], kParam)));
      },
      .param_state =
          [&](size_t i, const ParamState& ps) {
            const std::string& fqn = order[i];
            const int64_t numel = *checked_numel(ps.shape);  // checked above
            w.str("step");
            dcp::encode_tensor(w, DType::kF32, {},
                               add(StorageSpec::of_scalar(static_cast<float>(ps.step))));
            for (const char* m : kMoments) {
              const auto it = ps.entries.find(m);
              if (it == ps.entries.end()) continue;
              const Entry& e = it->second;
              w.str(m);
              if (steps_as_8bit(m, e, numel)) {
                const std::string codes = add(StorageSpec::of_component(fqn, m, Component::kCodes));
                const std::string scale = add(StorageSpec::of_component(fqn, m, Component::kAbsmax));
                // torchao's subclass claims the param's dtype (float32 where optstate has none other)
                const DType apparent = ps.param_dtype == DType::kBF16 || ps.param_dtype == DType::kF16 ? ps.param_dtype
                                                                                                       : DType::kF32;
                encode_optim_state_8bit(w, ps.shape, apparent, e.block_size, m == std::string(kExpAvg), codes, scale,
                                        qmap_storage(e.qmap), package);
              } else if (e.encoding == Encoding::kDense) {
                dcp::encode_tensor(w, e.dtype, ps.shape, add(StorageSpec::of_component(fqn, m)));
              } else {
                dcp::encode_tensor(w, DType::kF32, ps.shape, add(StorageSpec::of_f32_values(fqn, m)));
              }
            }
          },
      .group_fields =
          [&](size_t, const Hyperparameters& h) {
            w.str("amsgrad");
            w.boolean(h.amsgrad);
          },
      .lr =
          [&](size_t, const Hyperparameters& h) {
            dcp::encode_tensor(w, DType::kF32, {},
                               add(StorageSpec::of_scalar(static_cast<float>(h.lr))));
          },
      .optimizer_only = options.optimizer_only,
      .group_extra = torchsave::group_extras_writer(w, add, options, state.groups.size(), /*tensor_lr=*/true),
      .model_tensors = options.model_tensors,
      .model_tensor = torchsave::model_tensor_writer(w, add),
      .per_param = options.per_param,
      .stateless_optimizer = options.stateless_optimizer,
  });
  return Status::Ok();
}

OptimizerState kept_state(const OptimizerState& state, const KeepsEight& eight) {
  OptimizerState out = state;
  for (ParamGroup& g : out.groups) g.hyper.lr = static_cast<double>(static_cast<float>(g.hyper.lr));
  bool any8 = false;
  for (auto& [fqn, ps] : out.params) {
    const auto numel = checked_numel(ps.shape);
    for (auto& [name, e] : ps.entries) {
      if (name == kParam || e.encoding == Encoding::kDense) continue;
      if (numel.ok() && (eight ? eight(name, e, ps) : steps_as_8bit(name, e, *numel))) {
        any8 = true;
        continue;
      }
      Entry dense;
      dense.dtype = DType::kF32;
      if (e.codes.size > 0 && numel.ok())
        if (auto v = entry_f32_values(e, *numel, entry_key(fqn, name)); v.ok())
          dense.values = Buffer::copy_of(std::as_bytes(std::span(*v)));
      e = std::move(dense);
    }
    // Read back, an OptimState8bit's dtype is the param's (float32 written for another).
    bool eight = false;
    for (const auto& [name, e] : ps.entries) eight = eight || (name != kParam && e.encoding == Encoding::kBlockwise8);
    if (eight && !ps.entries.count(kParam) && ps.param_dtype != DType::kBF16 && ps.param_dtype != DType::kF16)
      ps.param_dtype = DType::kF32;
  }
  out.kind = any8 ? "adamw8bit" : "adamw";
  return out;
}

}  // namespace optstate::torchao
