#include "bnb_layout.h"

#include <fmt/format.h>

#include <map>
#include <set>

#include "dcp/bnb_state.h"
#include "dcp/dcp_layout.h"
#include "dcp/pickle.h"
#include "optstate/quant8.h"
#include "optstate/transform.h"
#include "torchsave/torchsave_layout.h"
#include "torchsave/torchsave_reader.h"

namespace optstate::bitsandbytes {

bool steps_as_8bit(const std::string& moment, const Entry& e) {
  return e.encoding == Encoding::kBlockwise8 && e.block_size == kBlockSize &&
         e.qmap == qmap_name(moment == kExpAvg ? QMap::kDynamicSigned : QMap::kDynamicUnsigned);
}

Result<Layout> written_layout(const WriteOptions& options) {
  if (options.bitsandbytes_layout == "nested") return Layout::kNested;
  if (options.bitsandbytes_layout == "flat") return Layout::kFlat;
  if (!options.bitsandbytes_layout.empty())
    return invalid_argument(fmt::format("bitsandbytes layout '{}': nested (bitsandbytes 0.49.2 and later) or flat "
                                        "(every release)", printable(options.bitsandbytes_layout)));
  if (options.source)
    if (const auto nested = torchsave::bnb_nested(*options.source)) return *nested ? Layout::kNested : Layout::kFlat;
  return Layout::kNested;
}

Result<Plan> plan_state_dict(const OptimizerState& state, Layout layout) {
  return torchsave::plan_of([&](pickle::Writer& w, const torchsave::SpecSink& add, const torchsave::FrameOptions& fo) {
    return plan_frame(state, w, add, fo, layout);
  });
}

Status plan_frame(const OptimizerState& state, pickle::Writer& w, const torchsave::SpecSink& add,
                  const torchsave::FrameOptions& options, Layout layout) {
  OPTSTATE_RETURN_IF_ERROR(check_structure(state, false));
  const std::vector<std::string> order = torchsave::param_order(state);
  if (order.size() != state.params.size() || std::set(order.begin(), order.end()).size() != order.size())
    return invalid_argument("bitsandbytes: every param must be in exactly one param group (torch numbers them by it)");
  for (size_t g = 0; g < state.groups.size(); ++g) {
    const Hyperparameters& h = state.groups[g].hyper;
    if (h.amsgrad || h.maximize)
      return invalid_argument(fmt::format("param group {}: {}; bitsandbytes' AdamW has neither amsgrad nor maximize",
                                          g, h.amsgrad ? "amsgrad" : "maximize"));
  }
  for (size_t i = 0; i < order.size(); ++i) {
    const ParamState& ps = state.params.at(order[i]);
    for (const auto& [name, e] : ps.entries)
      if (name != kParam && name != kExpAvg && name != kExpAvgSq)
        return invalid_argument(fmt::format("param '{}': entry '{}' has no place in bitsandbytes' AdamW state", order[i], name));
    if (ps.entries.count(kExpAvg) != ps.entries.count(kExpAvgSq))
      return invalid_argument(fmt::format("param '{}' has only one of exp_avg and exp_avg_sq", order[i]));
    OPTSTATE_RETURN_IF_ERROR(checked_numel(ps.shape).status());
  }

  std::map<std::string, std::string> map_key;  // map name -> its one storage, shared as bitsandbytes shares it
  auto tensor = [&](StorageSpec s, DType d, const std::vector<int64_t>& shape) {
    if (s.what == StorageSpec::What::kQMap) {
      const auto it = map_key.find(s.qmap);
      if (it != map_key.end()) {
        dcp::encode_tensor(w, d, shape, it->second);
        return;
      }
      const std::string name = s.qmap;
      dcp::encode_tensor(w, d, shape, map_key[name] = add(std::move(s)));
      return;
    }
    dcp::encode_tensor(w, d, shape, add(std::move(s)));
  };
  torchsave::encode_state_dict_frame(state, w, {
      .weight = [&](size_t i, const ParamState& ps) {
        tensor(StorageSpec::of_component(order[i], kParam), ps.entries.at(kParam).dtype, ps.shape);
      },
      .param_state =
          [&](size_t i, const ParamState& ps) {
            const std::string& fqn = order[i];
            w.str("step");
            w.integer(ps.step);  // a Python int, as bitsandbytes counts
            if (layout == Layout::kNested) {
              w.str(dcp::kBnbQuantState);
              w.empty_dict();
              w.mark();
            }
            // bitsandbytes' own order: state1, qmap1, state2, qmap2, absmax1, absmax2.
            const char* moments[2] = {kExpAvg, kExpAvgSq};
            bool eight[2];
            for (int n = 0; n < 2; ++n) {
              const Entry& e = ps.entries.at(moments[n]);
              eight[n] = steps_as_8bit(moments[n], e);
              w.str(fmt::format("state{}", n + 1));
              if (eight[n]) {
                tensor(StorageSpec::of_component(fqn, moments[n], Component::kCodes), DType::kU8, ps.shape);
                w.str(fmt::format("qmap{}", n + 1));
                tensor(StorageSpec::of_qmap(e.qmap), DType::kF32, {256});
              } else {  // 32-bit state: bitsandbytes steps fp32 moments
                const bool as_is = e.encoding == Encoding::kDense && e.dtype == DType::kF32;
                tensor(as_is ? StorageSpec::of_component(fqn, moments[n]) : StorageSpec::of_f32_values(fqn, moments[n]),
                       DType::kF32, ps.shape);
              }
            }
            const int64_t numel = *checked_numel(ps.shape);  // checked above
            for (int n = 0; n < 2; ++n) {
              if (!eight[n]) continue;
              w.str(fmt::format("absmax{}", n + 1));
              tensor(StorageSpec::of_component(fqn, moments[n], Component::kAbsmax), DType::kF32,
                     {(numel + kBlockSize - 1) / kBlockSize});
            }
            if (layout == Layout::kNested) w.setitems_from_mark();
          },
      // The rest of bitsandbytes' group (0.50): AdEMAMix's fields, inert for AdamW.
      .group_fields =
          [&](size_t, const Hyperparameters&) {
            w.str("alpha");
            w.real(0.0);
            w.str("t_alpha");
            w.none();
            w.str("t_beta3");
            w.none();
          },
      .lr = {},
      .optimizer_only = options.optimizer_only,
      .group_extra = torchsave::group_extras_writer(w, add, options, state.groups.size(), /*tensor_lr=*/false),
      .model_tensors = options.model_tensors,
      .model_tensor = torchsave::model_tensor_writer(w, add),
      .per_param = options.per_param,
      .stateless_optimizer = options.stateless_optimizer,
  });
  return Status::Ok();
}

OptimizerState kept_state(const OptimizerState& state) {
  OptimizerState out = state;
  bool any8 = false;
  for (auto& [fqn, ps] : out.params) {
    const auto numel = checked_numel(ps.shape);
    for (auto& [name, e] : ps.entries) {
      if (name == kParam) continue;
      if (steps_as_8bit(name, e)) {
        any8 = true;
        continue;
      }
      Entry dense;
      dense.dtype = DType::kF32;
      const bool filled = e.encoding == Encoding::kDense ? e.values.size > 0 : e.codes.size > 0;
      if (filled && numel.ok())
        if (auto v = entry_f32_values(e, *numel, entry_key(fqn, name)); v.ok())
          dense.values = Buffer::copy_of(std::as_bytes(std::span(*v)));
      e = std::move(dense);
    }
  }
  out.kind = any8 ? "adamw8bit" : "adamw";
  return out;
}

}  // namespace optstate::bitsandbytes
