// The torch ops behind the Python package (python/optstate): the fused AdamW step over lists of
// tensors, and native checkpoint save/load. Python only gathers tensors; all math and I/O is here.
#include <cstring>
#include <optional>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <nlohmann/json.hpp>

#include "adamw8bit_kernel.h"
#include "adamw_kernel.h"
#include "c10d_coordinator.h"
#include "op_checks.h"
#include "op_overloads.h"
#include "native/native_sharded.h"
#include "optstate/checkpoint.h"
#include "optstate/json_fields.h"
#include "optstate/quant8.h"
#include "optstate/shard.h"
#include "optstate/transform.h"
#include "registry.h"
#include "torch_bridge.h"

namespace optstate::optim {
namespace {

using json = nlohmann::json;

void fused_adamw_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                     at::TensorList max_exp_avg_sqs, at::TensorList steps, const LrArg& lr, double beta1,
                     double beta2, double eps, double weight_decay, bool amsgrad, bool maximize) {
  check_fused_adamw_args(OpBackend::kCpu, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, amsgrad);
  check_lr(OpBackend::kCpu, lr, at::Tensor(), "optstate.fused_adamw_");
  const size_t n = params.size();
  const AdamWHyper hyper{lr_value(lr), beta1, beta2, eps, weight_decay, amsgrad, maximize};
  std::vector<AdamWTensor> items(n);
  for (size_t i = 0; i < n; ++i) {
    at::Tensor step = steps[i];
    float* sp = step.data_ptr<float>();
    *sp += 1.0f;  // as torch's AdamW: the step tensor counts completed steps
    AdamWTensor& t = items[i];
    t.param = params[i].data_ptr();
    t.grad = grads[i].const_data_ptr();
    t.exp_avg = exp_avgs[i].data_ptr<float>();
    t.exp_avg_sq = exp_avg_sqs[i].data_ptr<float>();
    t.max_exp_avg_sq = amsgrad ? max_exp_avg_sqs[i].data_ptr<float>() : nullptr;
    t.numel = params[i].numel();
    t.kind = params[i].scalar_type() == at::kFloat ? ParamKind::kF32 : ParamKind::kBF16;
    t.s = adamw_step_scalars(hyper, static_cast<int64_t>(*sp));
  }
  adamw_cpu(items);
}

// 8-bit AdamW over lists. Per param i: block_sizes[i] > 0 means exp_avgs[i] etc. are uint8 codes
// with fp32 absmax in the *_absmax lists; block_sizes[i] == 0 means dense fp32 moments (the absmax
// entries are then ignored).
void adamw8bit_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                   at::TensorList max_exp_avg_sqs, at::TensorList exp_avg_absmax, at::TensorList exp_avg_sq_absmax,
                   at::TensorList max_exp_avg_sq_absmax, at::TensorList steps, at::IntArrayRef block_sizes,
                   const LrArg& lr, double beta1, double beta2, double eps, double weight_decay, bool amsgrad) {
  check_adamw8bit_args(OpBackend::kCpu, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, exp_avg_absmax,
                       exp_avg_sq_absmax, max_exp_avg_sq_absmax, steps, block_sizes, amsgrad);
  check_lr(OpBackend::kCpu, lr, at::Tensor(), "optstate.adamw8bit_");
  const size_t n = params.size();
  const AdamWHyper hyper{lr_value(lr), beta1, beta2, eps, weight_decay, amsgrad, false};
  std::vector<AdamW8bitTensor> items(n);
  for (size_t i = 0; i < n; ++i) {
    at::Tensor step = steps[i];
    float* sp = step.data_ptr<float>();
    *sp += 1.0f;
    AdamW8bitTensor& t = items[i];
    t.param = params[i].data_ptr();
    t.grad = grads[i].const_data_ptr();
    t.kind = params[i].scalar_type() == at::kFloat ? ParamKind::kF32 : ParamKind::kBF16;
    t.numel = params[i].numel();
    t.block = block_sizes[i];
    set_adamw8bit_state(t, i, t.block, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, exp_avg_absmax, exp_avg_sq_absmax,
                        max_exp_avg_sq_absmax, amsgrad);
    t.s = adamw8bit_step_scalars(hyper, *sp);
  }
  adamw8bit_cpu(items);
}

[[noreturn]] void raise(const Status& st) { TORCH_CHECK(false, "optstate: ", st.message()); }

// meta_json: {"kind", "param_groups": [{lr, betas, eps, weight_decay, amsgrad, maximize, params: [fqn]}],
//             "params": {fqn: {"shape", "dtype", "step", "group",
//                              "entries": {name: {"encoding": "blockwise8", "block_size", "qmap"}}}}}
// Tensors come as parallel lists (param fqn, entry name, component, tensor); dense entries need no
// "entries" record (their dtype is the tensor's).
// With `layout`, buffers hold one rank's ranges (shard_range; whole "param" entries with whole_params),
// any tensor shape of the right element count; without, each tensor has the param's global shape.
OptimizerState state_from_lists(const std::string& meta_json, const std::vector<std::string>& param_names,
                                const std::vector<std::string>& entry_names,
                                const std::vector<std::string>& components, at::TensorList tensors,
                                const ShardLoadOptions* layout = nullptr) {
  TORCH_CHECK(param_names.size() == tensors.size() && entry_names.size() == tensors.size() &&
                  components.size() == tensors.size(),
              "optstate.save: name and tensor lists differ in length");
  json meta = json::parse(meta_json);
  OptimizerState st;
  st.kind = meta.at("kind").get<std::string>();
  for (const json& g : meta.at("param_groups")) {
    ParamGroup pg;
    pg.hyper.lr = g.at("lr").get<double>();
    pg.hyper.beta1 = g.at("betas").at(0).get<double>();
    pg.hyper.beta2 = g.at("betas").at(1).get<double>();
    pg.hyper.eps = g.at("eps").get<double>();
    pg.hyper.weight_decay = g.at("weight_decay").get<double>();
    pg.hyper.amsgrad = g.at("amsgrad").get<bool>();
    pg.hyper.maximize = g.at("maximize").get<bool>();
    pg.params = g.at("params").get<std::vector<std::string>>();
    st.groups.push_back(std::move(pg));
  }
  for (const auto& [fqn, pj] : meta.at("params").items()) {
    ParamState ps;
    ps.shape = pj.at("shape").get<std::vector<int64_t>>();
    auto d = dtype_from_torch_name(pj.at("dtype").get<std::string>());
    TORCH_CHECK(d.has_value(), "optstate.save: unsupported param dtype ", pj.at("dtype").dump());
    ps.param_dtype = *d;
    ps.step = pj.at("step").get<int64_t>();
    ps.group = pj.at("group").get<int>();
    if (pj.contains("entries"))
      for (const auto& [name, ej] : pj.at("entries").items()) {
        Entry e;
        e.encoding = Encoding::kBlockwise8;
        e.dtype = DType::kU8;
        e.block_size = ej.at("block_size").get<int64_t>();
        e.qmap = ej.at("qmap").get<std::string>();
        ps.entries.emplace(name, std::move(e));
      }
    st.params.emplace(fqn, std::move(ps));
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    auto it = st.params.find(param_names[i]);
    TORCH_CHECK(it != st.params.end(), "optstate.save: tensor for unknown param '", param_names[i], "'");
    auto comp = component_from_name(components[i]);
    if (!comp.ok()) raise(comp.status());
    const std::string key = entry_key(param_names[i], entry_names[i]);
    Entry& e = it->second.entries[entry_names[i]];
    if (*comp == Component::kValues) {
      auto dtype = dtype_of(tensors[i].scalar_type());
      if (!dtype.ok()) raise(dtype.status());
      TORCH_CHECK(layout || shape_of(tensors[i]) == it->second.shape, "optstate.save: entry '", key,
                  "' has shape ", tensors[i].sizes(), ", param has ", format_shape(it->second.shape));
      e.encoding = Encoding::kDense;
      e.dtype = *dtype;
    } else {
      TORCH_CHECK(e.encoding == Encoding::kBlockwise8, "optstate.save: entry '", key,
                  "' has 8-bit components but no blockwise8 record");
      TORCH_CHECK(tensors[i].scalar_type() == (*comp == Component::kCodes ? at::kByte : at::kFloat),
                  "optstate.save: entry '", key, "' ", components[i], " has dtype ", tensors[i].scalar_type());
    }
    e.buffer(*comp) = buffer_of(tensors[i]);
  }
  if (layout) {
    for (const auto& [fqn, ps] : st.params) {
      auto numel = checked_numel(ps.shape);
      if (!numel.ok()) raise(numel.status());
      for (const auto& [name, e] : ps.entries)
        for (Component c : e.components()) {
          const FlatRange r = layout->whole_params && name == kParam
                                  ? FlatRange{0, component_count(e, c, *numel)}
                                  : shard_range(e, c, ps.shape, layout->world, layout->rank);
          TORCH_CHECK(static_cast<int64_t>(e.buffer(c).size) == r.size() * component_elem_size(e, c),
                      "optstate: entry '", entry_key(fqn, name), "' ", component_name(c), " of rank ", layout->rank,
                      " of ", layout->world, " holds ", e.buffer(c).size, " bytes; its range [", r.begin, ", ",
                      r.end, ") needs ", r.size() * component_elem_size(e, c));
        }
    }
  }
  return st;
}

void save_native(const std::string& path, const std::string& meta_json, std::vector<std::string> param_names,
                 std::vector<std::string> entry_names, std::vector<std::string> components, at::TensorList tensors,
                 bool overwrite, bool dequantize) {
  OptimizerState st = state_from_lists(meta_json, param_names, entry_names, components, tensors);
  WriteOptions wo;
  wo.overwrite = overwrite;
  wo.dequantize = dequantize;
  Status status = write_checkpoint(*find_format("native"), st, path, wo);
  if (!status.ok()) raise(status);
}

ShardLoadOptions shard_options(const std::string& to, int64_t block_size, int64_t min_8bit_size, int64_t world,
                               int64_t rank, bool whole_params) {
  auto target = target_encoding_from_name(to);
  if (!target.ok()) raise(target.status());
  ShardLoadOptions o;
  o.world = static_cast<int>(world);
  o.rank = static_cast<int>(rank);
  o.to = *target;
  o.quant = {block_size, min_8bit_size};
  o.whole_params = whole_params;
  return o;
}

// A loaded state's metadata for the Python side: kind, format, param groups, and per param its
// shape, dtype, step, group and entries' encodings (state_from_lists reads the same layout).
std::string meta_json(const OptimizerState& state, std::string_view format) {
  json meta;
  meta["kind"] = state.kind;
  meta["format"] = std::string(format);
  json groups = json::array();
  for (const auto& g : state.groups) groups.push_back(param_group_to_json(g));
  meta["param_groups"] = groups;
  json params = json::object();
  for (const auto& [fqn, ps] : state.params) {
    json entries = json::object();
    for (const auto& [name, e] : ps.entries) {
      entries[name] = {{"encoding", encoding_name(e.encoding)}};
      if (e.encoding == Encoding::kBlockwise8) {
        entries[name]["block_size"] = e.block_size;
        entries[name]["qmap"] = e.qmap;
      }
    }
    params[fqn] = {{"shape", ps.shape},
                   {"dtype", std::string(dtype_info(ps.param_dtype).torch_name)},
                   {"step", ps.step},
                   {"group", ps.group},
                   {"entries", entries}};
  }
  meta["params"] = params;
  return meta.dump();
}

// One rank's ranges of a checkpoint (world 1: the whole state) in the encoding the optimizer keeps:
// dense fp32, or 8-bit for its eligible params. A tensor holding a whole entry has the param's shape;
// a partial range is 1-d.
using LoadedLists = std::tuple<std::string, std::vector<std::string>, std::vector<std::string>,
                               std::vector<std::string>, std::vector<at::Tensor>>;

std::unique_ptr<CheckpointReader> open_or_raise(const std::string& path) {
  auto reader = open_checkpoint(path);
  if (!reader.ok()) raise(reader.status());
  return std::move(*reader);
}

LoadedLists load_native_shard_from(CheckpointReader& reader, const std::string& to, int64_t block_size,
                                   int64_t min_8bit_size, int64_t world, int64_t rank, bool whole_params,
                                   const std::vector<std::string>& dest_params,
                                   const std::vector<std::string>& dest_entries,
                                   const std::vector<std::string>& dest_components, at::TensorList dests) {
  ShardLoadOptions o = shard_options(to, block_size, min_8bit_size, world, rank, whole_params);
  TORCH_CHECK(dest_params.size() == dests.size() && dest_entries.size() == dests.size() &&
                  dest_components.size() == dests.size(),
              "optstate.load: destination name and tensor lists differ in length");
  // Tensors the caller already has (live weights, existing state): read into them in place.
  std::map<std::tuple<std::string, std::string, std::string>, at::Tensor> dest;
  for (size_t i = 0; i < dests.size(); ++i) dest[{dest_params[i], dest_entries[i], dest_components[i]}] = dests[i];
  std::map<const std::byte*, at::Tensor> placed;
  if (!dest.empty())
    o.destination = [&](const std::string& fqn, const std::string& entry, Component c, const Entry& target,
                        size_t bytes) -> std::span<std::byte> {
      auto it = dest.find({fqn, entry, std::string(component_name(c))});
      if (it == dest.end()) return {};
      const at::Tensor& t = it->second;
      const DType want = c == Component::kValues ? target.dtype : c == Component::kCodes ? DType::kU8 : DType::kF32;
      auto have = dtype_of(t.scalar_type());
      if (!have.ok() || *have != want || !t.is_cpu() || !t.is_contiguous() || t.nbytes() != bytes || bytes == 0)
        return {};
      auto* p = static_cast<std::byte*>(t.data_ptr());
      placed[p] = t;
      return {p, bytes};
    };
  auto state = load_shard(reader, o);
  if (!state.ok()) raise(state.status());
  std::vector<std::string> pnames, enames, cnames;
  std::vector<at::Tensor> tensors;
  for (auto& [fqn, ps] : state->params) {
    const int64_t numel = *checked_numel(ps.shape);
    for (auto& [name, e] : ps.entries) {
      for (Component c : e.components()) {
        const int64_t count = static_cast<int64_t>(e.buffer(c).size) / component_elem_size(e, c);
        const std::vector<int64_t> shape =
            c != Component::kAbsmax && count == numel ? ps.shape : std::vector<int64_t>{count};
        if (auto it = placed.find(e.buffer(c).data); it != placed.end() && !e.buffer(c).owner) {
          pnames.push_back(fqn);
          enames.push_back(name);
          cnames.emplace_back(component_name(c));
          tensors.push_back(it->second);
          continue;
        }
        Result<at::Tensor> t = tensor_taking(std::move(e.buffer(c)), c == Component::kValues ? e.dtype
                                                      : c == Component::kCodes ? DType::kU8
                                                                               : DType::kF32,
                                         shape);
        if (!t.ok()) raise(t.status());
        pnames.push_back(fqn);
        enames.push_back(name);
        cnames.emplace_back(component_name(c));
        tensors.push_back(*t);
      }
    }
  }
  return {meta_json(*state, reader.format()), pnames, enames, cnames, tensors};
}

LoadedLists load_native_shard(const std::string& path, const std::string& to, int64_t block_size,
                              int64_t min_8bit_size, int64_t world, int64_t rank, bool whole_params,
                              const std::vector<std::string>& dest_params, const std::vector<std::string>& dest_entries,
                              const std::vector<std::string>& dest_components, at::TensorList dests) {
  return load_native_shard_from(*open_or_raise(path), to, block_size, min_8bit_size, world, rank, whole_params,
                                dest_params, dest_entries, dest_components, dests);
}

// The model's other tensors a checkpoint holds beside the state (CheckpointReader::model_tensors:
// a torch.save file's or a DCP's buffers, frozen params, a tied weight's second name): (names,
// tensors). `mode` "meta": nothing read, each a meta-device tensor of its dtype and shape; "check":
// the same after every byte was read and checked against the file's checksums (nothing kept);
// "load": read, into the tensor of `dests` given under its name where that one is a contiguous
// CPU tensor of its dtype and shape (a live buffer: nothing allocated), else into a new CPU tensor.
std::tuple<std::vector<std::string>, std::vector<at::Tensor>> load_model_tensors_from(
    CheckpointReader& reader, const std::string& mode, const std::vector<std::string>& dest_names,
    const std::vector<at::Tensor>& dests) {
  if (mode != "meta" && mode != "check" && mode != "load")
    raise(invalid_argument(fmt::format("load_model_tensors: mode '{}' is none of meta, check, load", mode)));
  if (dest_names.size() != dests.size()) raise(invalid_argument("load_model_tensors: names and tensors differ in count"));
  std::map<std::string, at::Tensor> dest;
  for (size_t i = 0; i < dests.size(); ++i) dest.emplace(dest_names[i], dests[i]);
  std::vector<std::string> names;
  std::vector<at::Tensor> tensors;
  const std::span<const ModelTensorInfo> infos = reader.model_tensors();
  for (size_t i = 0; i < infos.size(); ++i) {
    const ModelTensorInfo& info = infos[i];
    const auto options = at::TensorOptions().dtype(scalar_type_of(info.dtype));
    at::Tensor t;
    if (mode != "load") {
      t = at::empty(info.shape, options.device(at::kMeta));
    } else if (auto it = dest.find(info.name); it != dest.end() && it->second.is_cpu() && it->second.is_contiguous() &&
                                                it->second.scalar_type() == options.dtype().toScalarType() &&
                                                it->second.sizes().vec() == info.shape) {
      t = it->second;
    } else {
      t = at::empty(info.shape, options);
    }
    auto* into = mode == "load" ? static_cast<std::byte*>(t.data_ptr()) : nullptr;
    uint64_t got = 0;
    if (mode != "meta") {
      const Status st = stream_model_tensor_exactly(reader, i, [&](std::span<const std::byte> piece) {
        if (into) std::memcpy(into + got, piece.data(), piece.size());
        got += piece.size();
        return Status::Ok();
      });
      if (!st.ok()) raise(st);
    }
    names.push_back(info.name);
    tensors.push_back(std::move(t));
  }
  return {names, tensors};
}

std::tuple<std::vector<std::string>, std::vector<at::Tensor>> load_model_tensors(
    const std::string& path, const std::string& mode, const std::vector<std::string>& dest_names,
    const std::vector<at::Tensor>& dests) {
  return load_model_tensors_from(*open_or_raise(path), mode, dest_names, dests);
}

// optstate.verify's check of the model's other tensors: each of `live` (CPU, contiguous, in the
// checkpoint tensor's dtype and shape) against the checkpoint tensor of its name, byte for byte:
// one line per tensor that differs, naming its first differing element.
std::vector<std::string> verify_model_tensors_from(CheckpointReader& reader, const std::vector<std::string>& names,
                                                   const std::vector<at::Tensor>& live) {
  TORCH_CHECK(names.size() == live.size(), "optstate.verify: name and tensor lists differ in length");
  std::map<std::string, at::Tensor> by_name;
  for (size_t i = 0; i < names.size(); ++i) by_name.emplace(names[i], live[i]);
  std::vector<std::string> diffs;
  const std::span<const ModelTensorInfo> infos = reader.model_tensors();
  for (size_t i = 0; i < infos.size(); ++i) {
    const ModelTensorInfo& info = infos[i];
    const auto it = by_name.find(info.name);
    if (it == by_name.end()) continue;
    const at::Tensor& t = it->second;
    TORCH_CHECK(t.is_cpu() && t.is_contiguous() && t.scalar_type() == scalar_type_of(info.dtype) &&
                    t.sizes().vec() == info.shape,
                "optstate.verify: model tensor '", info.name, "' is not a contiguous CPU tensor of its dtype and shape");
    const auto* have = static_cast<const std::byte*>(t.data_ptr());
    const uint64_t elem = dtype_size(info.dtype);
    uint64_t at = 0;
    std::optional<uint64_t> first;
    const Status st = stream_model_tensor_exactly(reader, i, [&](std::span<const std::byte> piece) {
      if (!first && std::memcmp(have + at, piece.data(), piece.size()) != 0)
        for (size_t k = 0; k < piece.size() && !first; ++k)
          if (have[at + k] != piece[k]) first = (at + k) / elem;
      at += piece.size();
      return Status::Ok();
    });
    if (!st.ok()) raise(st);
    if (first)
      diffs.push_back(fmt::format("model tensor '{}': differs from {} first at element {}", info.name,
                                  reader.path().string(), *first));
  }
  return diffs;
}

std::vector<std::string> verify_model_tensors(const std::string& path, const std::vector<std::string>& names,
                                              const std::vector<at::Tensor>& live) {
  return verify_model_tensors_from(*open_or_raise(path), names, live);
}

// load_native_shard's reading, verifying and converting without keeping or placing any byte:
// its metadata, or the error that load would raise. optstate.load runs this before a load that
// reads into live tensors, so a bad checkpoint leaves them as they were.
std::string check_native_shard_from(CheckpointReader& reader, const std::string& to, int64_t block_size,
                                    int64_t min_8bit_size, int64_t world, int64_t rank, bool whole_params) {
  ShardLoadOptions o = shard_options(to, block_size, min_8bit_size, world, rank, whole_params);
  o.check_only = true;
  auto state = load_shard(reader, o);
  if (!state.ok()) raise(state.status());
  return meta_json(*state, reader.format());
}

std::string check_native_shard(const std::string& path, const std::string& to, int64_t block_size,
                               int64_t min_8bit_size, int64_t world, int64_t rank, bool whole_params) {
  return check_native_shard_from(*open_or_raise(path), to, block_size, min_8bit_size, world, rank, whole_params);
}

std::tuple<std::string, std::vector<std::string>, std::vector<std::string>, std::vector<std::string>,
           std::vector<at::Tensor>>
load_native(const std::string& path, const std::string& to, int64_t block_size, int64_t min_8bit_size) {
  return load_native_shard(path, to, block_size, min_8bit_size, 1, 0, false, {}, {}, {}, {});
}

// Each rank passes its ranges (shard_range) of every entry; ranks meet through the c10d TCPStore at
// host:port that torch.distributed's process group already serves (every rank a client).
void save_native_sharded(const std::string& path, const std::string& meta_json, std::vector<std::string> param_names,
                         std::vector<std::string> entry_names, std::vector<std::string> components,
                         at::TensorList tensors, bool overwrite, const std::string& host, int64_t port, int64_t world,
                         int64_t rank, const std::string& save_id, double timeout_s) {
  const ShardLoadOptions layout = shard_options("", 0, 0, world, rank, false);
  OptimizerState st = state_from_lists(meta_json, param_names, entry_names, components, tensors, &layout);
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  auto coord = C10dCoordinator::connect(host, static_cast<int>(port), static_cast<int>(rank), static_cast<int>(world),
                                        timeout, /*serve=*/false);
  if (!coord.ok()) raise(coord.status());
  native::ShardedSaveOptions so;
  so.overwrite = overwrite;
  so.save_id = save_id;
  so.timeout = timeout;
  Status status = native::save_sharded(st, path, **coord, so);
  if (!status.ok()) raise(status);
}

// Resume validation of one rank's live state (the lists as save_native_sharded takes them, "param"
// entries whole): the differences from the checkpoint, empty when the live shard is the checkpoint's.
std::vector<std::string> verify_native_shard_from(CheckpointReader& reader, const std::string& meta_json,
                                                  const std::vector<std::string>& param_names,
                                                  const std::vector<std::string>& entry_names,
                                                  const std::vector<std::string>& components, at::TensorList tensors,
                                                  int64_t world, int64_t rank, bool whole_params) {
  const ShardLoadOptions layout = shard_options("", 0, 0, world, rank, whole_params);
  OptimizerState live = state_from_lists(meta_json, param_names, entry_names, components, tensors, &layout);
  auto diffs = verify_resume_shard(live, reader, layout);
  if (!diffs.ok()) raise(diffs.status());
  return *diffs;
}

std::vector<std::string> verify_native_shard(const std::string& path, const std::string& meta_json,
                                             std::vector<std::string> param_names, std::vector<std::string> entry_names,
                                             std::vector<std::string> components, at::TensorList tensors,
                                             int64_t world, int64_t rank, bool whole_params) {
  return verify_native_shard_from(*open_or_raise(path), meta_json, param_names, entry_names, components, tensors,
                                  world, rank, whole_params);
}

// The element range [begin, end) of a param's entries that `rank` of `world` owns: whole rows of dim 0
// (block_size 0: dense state) or whole quantization blocks.
std::vector<int64_t> shard_range_op(std::vector<int64_t> shape, int64_t block_size, int64_t world, int64_t rank) {
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "optstate.shard_range: rank ", rank, " of ", world);
  TORCH_CHECK(block_size >= 0, "optstate.shard_range: negative block size");
  Entry e;
  if (block_size > 0) {
    e.encoding = Encoding::kBlockwise8;
    e.dtype = DType::kU8;
    e.block_size = block_size;
  }
  const FlatRange r = shard_range(e, block_size > 0 ? Component::kCodes : Component::kValues, shape,
                                  static_cast<int>(world), static_cast<int>(rank));
  return {r.begin, r.end};
}

std::string cpu_isa() { return adamw_cpu_isa(); }
std::string cpu_isa_8bit() { return adamw8bit_cpu_isa(); }

QMap qmap_arg(const std::string& name) {
  auto m = qmap_from_name(name);
  if (!m.ok()) raise(m.status());
  return *m;
}

at::Tensor qmap_tensor(const std::string& name) {
  const auto& t = qmap_table(qmap_arg(name));
  return at::from_blob(const_cast<float*>(t.data()), {256}, at::kFloat).clone();
}

std::tuple<at::Tensor, at::Tensor> quantize_blockwise_op(const at::Tensor& x, int64_t block, const std::string& qmap) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "optstate.quantize_blockwise: float32 input expected");
  TORCH_CHECK(block > 0, "optstate.quantize_blockwise: block size must be positive");
  at::Tensor xc = x.contiguous();
  const int64_t n = xc.numel();
  at::Tensor codes = at::empty(xc.sizes(), at::kByte);
  at::Tensor absmax = at::empty({(n + block - 1) / block}, at::kFloat);
  quantize_blockwise({xc.const_data_ptr<float>(), static_cast<size_t>(n)}, block, qmap_arg(qmap),
                     {codes.data_ptr<uint8_t>(), static_cast<size_t>(n)},
                     {absmax.data_ptr<float>(), static_cast<size_t>(absmax.numel())});
  return {codes, absmax};
}

at::Tensor dequantize_blockwise_op(const at::Tensor& codes, const at::Tensor& absmax, int64_t block,
                                   const std::string& qmap) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && absmax.scalar_type() == at::kFloat,
              "optstate.dequantize_blockwise: uint8 codes and float32 absmax expected");
  at::Tensor c = codes.contiguous(), a = absmax.contiguous();
  TORCH_CHECK(block > 0 && a.numel() == (c.numel() + block - 1) / block,
              "optstate.dequantize_blockwise: absmax must hold one value per block");
  at::Tensor out = at::empty(c.sizes(), at::kFloat);
  dequantize_blockwise({c.const_data_ptr<uint8_t>(), static_cast<size_t>(c.numel())},
                       {a.const_data_ptr<float>(), static_cast<size_t>(a.numel())}, block, qmap_arg(qmap),
                       {out.data_ptr<float>(), static_cast<size_t>(out.numel())});
  return out;
}

// A checkpoint opened once for several reads: torch.classes.optstate.Checkpoint(path), whose methods
// are the path-taking ops above less their path. Opening parses every piece of metadata (a DCP's
// .metadata or a native manifest of 30,000 params: 1-3 s), which each path-taking op repeats;
// optstate.load's check pass, its load and the model's buffers, and read_state_dict's two reads,
// go through one of these instead.
struct OpenedCheckpoint : torch::CustomClassHolder {
  explicit OpenedCheckpoint(const std::string& path) : reader(open_or_raise(path)) {}
  std::unique_ptr<CheckpointReader> reader;
};

}  // namespace

TORCH_LIBRARY(optstate, m) {
  using Self = c10::intrusive_ptr<OpenedCheckpoint>;
  m.class_<OpenedCheckpoint>("Checkpoint")
      .def(torch::init<std::string>())
      .def("path", [](const Self& self) { return self->reader->path().string(); })
      .def("format", [](const Self& self) { return std::string(self->reader->format()); })
      // What `optstate inspect` prints as notes: where the path led (a save folder's tracker), then
      // values read as the file does not say them (the Python face warns with them).
      .def("read_notes", [](const Self& self) { return self->reader->all_read_notes(); })
      .def("load_native_shard",
           [](const Self& self, const std::string& to, int64_t block_size, int64_t min_8bit_size, int64_t world,
              int64_t rank, bool whole_params, const std::vector<std::string>& dest_params,
              const std::vector<std::string>& dest_entries, const std::vector<std::string>& dest_components,
              const std::vector<at::Tensor>& dests) {
             return load_native_shard_from(*self->reader, to, block_size, min_8bit_size, world, rank, whole_params,
                                           dest_params, dest_entries, dest_components, dests);
           })
      .def("check_native_shard",
           [](const Self& self, const std::string& to, int64_t block_size, int64_t min_8bit_size, int64_t world,
              int64_t rank, bool whole_params) {
             return check_native_shard_from(*self->reader, to, block_size, min_8bit_size, world, rank, whole_params);
           })
      .def("verify_native_shard",
           [](const Self& self, const std::string& meta_json, const std::vector<std::string>& param_names,
              const std::vector<std::string>& entry_names, const std::vector<std::string>& components,
              const std::vector<at::Tensor>& tensors, int64_t world, int64_t rank, bool whole_params) {
             return verify_native_shard_from(*self->reader, meta_json, param_names, entry_names, components, tensors,
                                             world, rank, whole_params);
           })
      .def("load_model_tensors",
           [](const Self& self, const std::string& mode, const std::vector<std::string>& dest_names,
              const std::vector<at::Tensor>& dests) {
             return load_model_tensors_from(*self->reader, mode, dest_names, dests);
           })
      .def("verify_model_tensors",
           [](const Self& self, const std::vector<std::string>& names, const std::vector<at::Tensor>& live) {
             return verify_model_tensors_from(*self->reader, names, live);
           });

  m.def(
      "fused_adamw_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] steps, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, bool amsgrad, bool maximize) -> ()");
  m.def(
      "fused_adamw_.tensor_lr(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] steps, Tensor lr, float beta1, float beta2, float eps, "
      "float weight_decay, bool amsgrad, bool maximize) -> ()");
  m.def(
      "adamw8bit_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] exp_avg_absmax, Tensor(f!)[] exp_avg_sq_absmax, "
      "Tensor(g!)[] max_exp_avg_sq_absmax, Tensor(h!)[] steps, int[] block_sizes, float lr, float beta1, "
      "float beta2, float eps, float weight_decay, bool amsgrad) -> ()");
  m.def(
      "adamw8bit_.tensor_lr(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] exp_avg_absmax, Tensor(f!)[] exp_avg_sq_absmax, "
      "Tensor(g!)[] max_exp_avg_sq_absmax, Tensor(h!)[] steps, int[] block_sizes, Tensor lr, float beta1, "
      "float beta2, float eps, float weight_decay, bool amsgrad) -> ()");
  m.def("save_native(str path, str meta_json, str[] param_names, str[] entry_names, str[] components, "
        "Tensor[] tensors, bool overwrite, bool dequantize) -> ()");
  m.def("load_native(str path, str to, int block_size, int min_8bit_size) -> (str, str[], str[], str[], Tensor[])");
  m.def("load_native_shard(str path, str to, int block_size, int min_8bit_size, int world, int rank, "
        "bool whole_params, str[] dest_params, str[] dest_entries, str[] dest_components, Tensor[] dests) "
        "-> (str, str[], str[], str[], Tensor[])");
  m.def("check_native_shard(str path, str to, int block_size, int min_8bit_size, int world, int rank, "
        "bool whole_params) -> str");
  m.def("save_native_sharded(str path, str meta_json, str[] param_names, str[] entry_names, str[] components, "
        "Tensor[] tensors, bool overwrite, str host, int port, int world, int rank, str save_id, float timeout_s) -> ()");
  m.def("verify_native_shard(str path, str meta_json, str[] param_names, str[] entry_names, str[] components, "
        "Tensor[] tensors, int world, int rank, bool whole_params) -> str[]");
  m.def("load_model_tensors(str path, str mode, str[] dest_names, Tensor[] dests) -> (str[], Tensor[])");
  m.def("verify_model_tensors(str path, str[] names, Tensor[] live) -> str[]");
  m.def("shard_range(int[] shape, int block_size, int world, int rank) -> int[]");
  m.def("cpu_isa() -> str");
  m.def("cpu_isa_8bit() -> str");
  m.def("qmap(str name) -> Tensor");
  m.def("quantize_blockwise(Tensor x, int block_size, str qmap) -> (Tensor, Tensor)");
  m.def("dequantize_blockwise(Tensor codes, Tensor absmax, int block_size, str qmap) -> Tensor");
}

TORCH_LIBRARY_IMPL(optstate, CPU, m) {
  m.impl("fused_adamw_", fused_adamw_float_lr<&fused_adamw_cpu>);
  m.impl("fused_adamw_.tensor_lr", fused_adamw_tensor_lr<&fused_adamw_cpu>);
  m.impl("adamw8bit_", adamw8bit_float_lr<&adamw8bit_cpu>);
  m.impl("adamw8bit_.tensor_lr", adamw8bit_tensor_lr<&adamw8bit_cpu>);
}
TORCH_LIBRARY_IMPL(optstate, CompositeExplicitAutograd, m) {
  m.impl("save_native", save_native);
  m.impl("load_native", load_native);
  m.impl("load_native_shard", load_native_shard);
  m.impl("check_native_shard", check_native_shard);
  m.impl("save_native_sharded", save_native_sharded);
  m.impl("verify_native_shard", verify_native_shard);
  m.impl("load_model_tensors", load_model_tensors);
  m.impl("verify_model_tensors", verify_model_tensors);
  m.impl("shard_range", shard_range_op);
  m.impl("cpu_isa", cpu_isa);
  m.impl("cpu_isa_8bit", cpu_isa_8bit);
  m.impl("qmap", qmap_tensor);
  m.impl("quantize_blockwise", quantize_blockwise_op);
  m.impl("dequantize_blockwise", dequantize_blockwise_op);
}

}  // namespace optstate::optim
