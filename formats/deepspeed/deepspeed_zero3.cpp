// A DeepSpeed ZeRO-3 checkpoint written again for another data-parallel world size: what DeepSpeed
// itself would have saved had the run been on `world` ranks. DeepSpeed loads a ZeRO checkpoint only
// on the world size it was saved with, and its universal checkpoint of a ZeRO-3 run loads with every
// param group given group 0's hyperparameters (FORMAT.md), so a ZeRO-3 run changes world size here.
//
// Each rank's files are rank 0's, written again (pickle::emit with a hook) with what depends on the
// world size made anew: in the optimizer file the flat params (sub-groups, as DeepSpeed forms them
// from `world` ranks' partition sizes), their fp32 partitions (fp32_flat_groups), the wrapped
// optimizer's moments and a step tensor each, the groups' lists of them and partition_count; in the
// model states file param_shapes (per flat param), dp_world_size and the frozen params' partitions.
// Every other value, tensors included (the module's placeholders), is carried as it was: its storage
// copied under the key it gets in the new file. Byte layout and checks: FORMAT.md.
#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <variant>

#include "deepspeed_zero3.h"
#include "dcp/dcp_layout.h"
#include "dcp/pickle.h"
#include "optstate/io.h"
#include "optstate/transform.h"
#include "torchsave/torchsave_archive.h"
#include "torchsave/torchsave_layout.h"
#include "torchsave/torchsave_planner.h"

namespace optstate::deepspeed {

namespace {

using pickle::Kind;
using pickle::Ref;

// A storage of the new file: one carried from the source file (its key there), or a new tensor
// (flat param, entry).
struct NewTensor {
  size_t flat = 0;  // a flat param; in a model states file: a frozen param
  std::string entry;  // an entry's partition; "step", the flat param's step as a 0-d tensor of `dtype`;
                      // "frozen", a frozen param's partition
  DType dtype = DType::kF32;
};
using Planned = torchsave::Planned<NewTensor>;
using Planner = torchsave::Planner<NewTensor>;

std::string rank_file(const std::string& rank0_name, int rank) {
  const std::string from = "zero_pp_rank_0_", to = fmt::format("zero_pp_rank_{}_", rank);
  std::string name = rank0_name;
  name.replace(name.find(from), from.size(), to);
  return name;
}

// A flat param on the new world size: its group and params (name, shape), in order.
struct Flat {
  size_t group = 0;
  std::vector<std::pair<std::string, std::vector<int64_t>>> params;
  int64_t length = 0;  // elements on each rank: the params' parts
};

// DeepSpeed's sub-groups (stage3.py, _create_fp16_sub_groups) of one param group on `world` ranks:
// params in order, each counted by its partition (ceil(numel / world)); a sub-group closes once it
// holds sub_group_size or more, and at the group's last param; one sub-group where the whole group's
// partitions fit.
std::vector<Flat> sub_groups(size_t group, const std::vector<std::pair<std::string, std::vector<int64_t>>>& params,
                             int64_t world, double sub_group_size) {
  std::vector<Flat> out;
  int64_t total = 0;
  for (const auto& [name, shape] : params) total += (*checked_numel(shape) + world - 1) / world;
  Flat cur{group, {}, 0};
  for (size_t i = 0; i < params.size(); ++i) {
    cur.params.push_back(params[i]);
    cur.length += (*checked_numel(params[i].second) + world - 1) / world;
    if (sub_group_size >= static_cast<double>(total) ? i + 1 == params.size()
                                                     : static_cast<double>(cur.length) >= sub_group_size || i + 1 == params.size()) {
      out.push_back(std::move(cur));
      cur = Flat{group, {}, 0};
    }
  }
  return out;
}

}  // namespace

Status write_zero3(StateSource& source, const fs::path& source_path, const fs::path& staging, int world) {
  OPTSTATE_ASSIGN_OR_RETURN(const auto z, torchsave::zero_files(source_path));
  if (!z) return invalid_argument(source_path.string() + ": no DeepSpeed ZeRO optimizer files");
  if (z->stages.size() > 1)
    return invalid_argument(fmt::format("{}: a ZeRO-3 checkpoint of {} tensor-parallel ranks (AutoTP); optstate writes "
                                        "a ZeRO-3 checkpoint for another world size from one without tensor "
                                        "parallelism: convert it to another format", z->dir.string(),
                                        z->stages.size()));
  const std::string ow = z->optim()[0].string(), mw = z->model().string();
  OPTSTATE_ASSIGN_OR_RETURN(auto opt, torchsave::open_archive(z->optim()[0]));
  OPTSTATE_ASSIGN_OR_RETURN(const torchsave::ZeroRank zr, torchsave::interpret_zero_optim(opt.second, ow));
  if (zr.stage != 3) return internal_error(ow + ": not a ZeRO-3 checkpoint");
  if (zr.bnb)
    return invalid_argument(ow + ": the optimizer DeepSpeed wraps is bitsandbytes' (state1/state2: 8-bit codes in "
                                 "blocks of each rank's partition, which another world size cuts differently); "
                                 "optstate reads it, as fp32 moments, but does not lay it out for other ranks: "
                                 "convert it to another format");
  OPTSTATE_ASSIGN_OR_RETURN(auto model, torchsave::open_archive(z->model()));
  OPTSTATE_ASSIGN_OR_RETURN(const torchsave::ZeroShapes shapes, torchsave::interpret_zero_model(model.second, mw));
  if (shapes.groups.size() != zr.groups.size())
    return corrupt(fmt::format("{}: {} flat params in param_shapes, {} in {}", mw, shapes.groups.size(), zr.groups.size(), ow));
  const pickle::Pickle& op = opt.second;
  const pickle::Pickle& mp = model.second;
  // Frozen params (LoRA's base model, say): each rank's model states file holds its partition of
  // each (frozen_param_fragments), which DeepSpeed loads as the param's. Put together from every
  // rank's file, to be cut again for `world` ranks.
  struct Frozen {
    Ref fragment;  // in rank 0's file
    DType dtype;
    int64_t numel = 0;
    std::vector<std::byte> values;  // the whole param, numel elements
  };
  std::vector<Frozen> frozen;
  if (const Ref fragments = mp.dict_get(mp.root(), "frozen_param_fragments");
      fragments != pickle::kNoRef && !mp.at(fragments).items.empty()) {
    const Ref frozen_shapes = mp.dict_get(mp.root(), "frozen_param_shapes");
    OPTSTATE_ASSIGN_OR_RETURN(const torchsave::ModelDict parts0,
                              torchsave::interpret_model_dict(mp, fragments, mw + " frozen_param_fragments"));
    std::vector<torchsave::ModelDict> parts = {parts0};
    std::vector<torchsave::Archive> archives;
    for (size_t f = 1; f < z->optim().size(); ++f) {
      const fs::path mf = z->dir / rank_file(z->model().filename().string(), static_cast<int>(f));
      OPTSTATE_ASSIGN_OR_RETURN(auto opened, torchsave::open_archive(mf));
      const Ref fr = opened.second.dict_get(opened.second.root(), "frozen_param_fragments");
      if (fr == pickle::kNoRef) return corrupt(mf.string() + ": no frozen_param_fragments; rank 0's file has them");
      OPTSTATE_ASSIGN_OR_RETURN(torchsave::ModelDict md,
                                torchsave::interpret_model_dict(opened.second, fr, mf.string() + " frozen_param_fragments"));
      parts.push_back(std::move(md));
      archives.push_back(std::move(opened.first));
    }
    const auto source_world = static_cast<int64_t>(z->optim().size());
    for (const torchsave::ModelTensor& t : parts0.tensors) {
      const std::string fw = fmt::format("{} frozen param '{}'", mw, t.name);
      const Ref size = frozen_shapes == pickle::kNoRef ? pickle::kNoRef : mp.dict_get(frozen_shapes, t.name);
      const auto shape = size == pickle::kNoRef ? std::nullopt : dcp::torch_size(mp, size);
      if (!shape) return corrupt(fw + ": not in frozen_param_shapes");
      OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(*shape));
      const int64_t part = (numel + source_world - 1) / source_world;
      const auto elem = static_cast<size_t>(dtype_size(t.tensor.dtype));
      // Every rank's partition read first (its storage, bounded by its file), then put together.
      std::vector<std::vector<std::byte>> pieces;
      for (int64_t f = 0; f < source_world; ++f) {
        const torchsave::ModelTensor* ft = parts[static_cast<size_t>(f)].find(t.name);
        if (!ft || ft->tensor.dtype != t.tensor.dtype || ft->tensor.shape != std::vector<int64_t>{part})
          return corrupt(fmt::format("{}: rank {}'s partition is not {} elements of {}", fw, f, part, dtype_name(t.tensor.dtype)));
        const torchsave::Archive& a = f == 0 ? model.first : archives[static_cast<size_t>(f - 1)];
        OPTSTATE_ASSIGN_OR_RETURN(std::vector<std::byte> bytes, torchsave::read_storage(a, ft->tensor.storage_key));
        const auto at = static_cast<uint64_t>(ft->tensor.offset) * elem;
        if (ft->tensor.offset < 0 || at > bytes.size() || static_cast<uint64_t>(part) * elem > bytes.size() - at)
          return corrupt(fmt::format("{}: rank {}'s partition lies past its storage", fw, f));
        bytes.erase(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(at));
        pieces.push_back(std::move(bytes));
      }
      Frozen fz{t.ref, t.tensor.dtype, numel, std::vector<std::byte>(static_cast<size_t>(numel) * elem)};
      for (int64_t f = 0; f < source_world; ++f) {
        const int64_t begin = std::min(numel, f * part), count = std::min(numel, begin + part) - begin;
        std::copy_n(pieces[static_cast<size_t>(f)].begin(), static_cast<size_t>(count) * elem,
                    fz.values.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(begin) * elem));
      }
      frozen.push_back(std::move(fz));
    }
  }
  // sub_group_size, from the run's config (DeepSpeed's default: 1e9 elements).
  double sub_group_size = 1e9;
  {
    const Ref config = op.dict_get(op.root(), "ds_config");
    const Ref zero = config == pickle::kNoRef ? pickle::kNoRef : op.dict_get(config, "zero_optimization");
    const Ref size = zero == pickle::kNoRef ? pickle::kNoRef : op.dict_get(zero, "sub_group_size");
    if (size != pickle::kNoRef) {
      const auto v = dcp::as_number(op, size);
      if (!v || !(*v >= 1)) return corrupt(ow + ": ds_config's sub_group_size is not a positive number");
      sub_group_size = *v;
    }
  }

  // Each param group's params, in order, and their flat params on `world` ranks.
  const OptimizerState& state = source.meta();
  const auto w = static_cast<int64_t>(world);
  std::vector<std::vector<std::pair<std::string, std::vector<int64_t>>>> group_params(zr.param_groups);
  for (size_t k = 0; k < shapes.groups.size(); ++k)
    for (const auto& param : shapes.groups[k]) group_params[zr.groups[k].param_group].push_back(param);
  std::vector<Flat> flats;
  for (size_t g = 0; g < group_params.size(); ++g)
    for (Flat& f : sub_groups(g, group_params[g], w, sub_group_size)) flats.push_back(std::move(f));
  std::vector<std::string> entries = {kParam};
  for (const auto& [name, t] : zr.groups[0].moments) entries.push_back(name);
  // No moments: the optimizer never stepped (every flat param alike, as interpret_zero_optim checks);
  // its state stays empty, and so must the state written.
  const bool stepped = entries.size() > 1;
  size_t listed = 0;
  for (const auto& params : group_params)
    for (const auto& [name, shape] : params) {
      const auto ps = state.params.find(name);
      if (ps == state.params.end()) return invalid_argument(fmt::format("{}: param '{}' is not in the state", mw, name));
      for (const std::string& e : entries)
        if (!ps->second.entries.count(e))
          return invalid_argument(fmt::format("param '{}': no '{}' entry, which DeepSpeed's ZeRO-3 state holds", name, e));
      if (!stepped && (ps->second.entries.size() != 1 || ps->second.step != 0))
        return invalid_argument(fmt::format("param '{}': optimizer state at step {}, but {}'s optimizer never stepped "
                                            "(its files hold no state to lay it out by)", name, ps->second.step, ow));
      ++listed;
    }
  if (listed != state.params.size())
    return invalid_argument(fmt::format("the state holds {} params, {}'s param_shapes {}", state.params.size(), mw, listed));

  // What depends on the world size in rank 0's optimizer file (checked by interpret_zero_optim).
  const Ref osd = op.dict_get(op.root(), "optimizer_state_dict");
  const Ref count = op.dict_get(osd, "partition_count");
  const Ref flat_list = op.dict_get(osd, "fp32_flat_groups");
  const Ref nested = op.dict_get(osd, "optimizer_state_dict");
  const Ref state_dict = op.dict_get(nested, "state");
  std::map<Ref, size_t> group_params_list;  // each group's 'params' list -> the group
  {
    const pickle::Value& groups = op.at(op.dict_get(nested, "param_groups"));
    for (size_t g = 0; g < groups.items.size(); ++g) group_params_list[op.dict_get(groups.items[g], "params")] = g;
  }
  // Each group's first flat param's state in the file: its keys in order, and its step (carried).
  std::vector<Ref> old_state(zr.param_groups, pickle::kNoRef);
  {
    const pickle::Value& st = op.at(state_dict);
    std::map<int64_t, Ref> by_id;
    for (size_t i = 0; i + 1 < st.items.size(); i += 2)
      if (op.at(st.items[i]).kind == Kind::kInt) by_id[op.at(st.items[i]).i] = st.items[i + 1];
    for (size_t k = zr.groups.size(); stepped && k-- > 0;) {
      const auto it = by_id.find(static_cast<int64_t>(k));
      if (it == by_id.end()) return corrupt(fmt::format("{}: no state for flat param {}", ow, k));
      old_state[zr.groups[k].param_group] = it->second;
    }
  }
  // Each group's step: a 0-d tensor (torch >= 1.12) of this dtype, or a number (carried).
  std::vector<std::optional<DType>> step_dtype(zr.param_groups);
  for (const torchsave::ZeroGroup& zg : zr.groups)
    if (zg.step.tensor) {
      if (zg.step.tensor->dtype != DType::kF32 && zg.step.tensor->dtype != DType::kF64)
        return corrupt(fmt::format("{}: a {} step tensor", ow, dtype_name(zg.step.tensor->dtype)));
      step_dtype[zg.param_group] = zg.step.tensor->dtype;
    }
  Planner optim_planner(op, ow);
  OPTSTATE_ASSIGN_OR_RETURN(
      const Planned optim_plan,
      optim_planner.run([&](pickle::Writer& wr, Ref r, Planned& out, const Planner::Carry& carry) -> Result<bool> {
        auto tensor = [&](size_t flat, const std::string& entry) {
          dcp::encode_tensor(wr, DType::kF32, {flats[flat].length}, std::to_string(out.storages.size()));
          out.storages.emplace_back(NewTensor{flat, entry});
        };
        if (r == count) {
          wr.integer(w);
        } else if (r == flat_list) {
          wr.empty_list();
          wr.mark();
          for (size_t k = 0; k < flats.size(); ++k) tensor(k, kParam);
          wr.appends_from_mark();
        } else if (const auto g = group_params_list.find(r); g != group_params_list.end()) {
          wr.empty_list();
          wr.mark();
          for (size_t k = 0; k < flats.size(); ++k)
            if (flats[k].group == g->second) wr.integer(static_cast<int64_t>(k));
          wr.appends_from_mark();
        } else if (r == state_dict) {
          wr.empty_dict();
          wr.mark();
          for (size_t k = 0; stepped && k < flats.size(); ++k) {
            wr.integer(static_cast<int64_t>(k));
            wr.empty_dict();
            wr.mark();
            const pickle::Value& fields = op.at(old_state[flats[k].group]);
            for (size_t i = 0; i + 1 < fields.items.size(); i += 2) {
              OPTSTATE_RETURN_IF_ERROR(carry(fields.items[i]));
              const auto name = dcp::as_string(op, fields.items[i]);
              if (name && std::find(entries.begin(), entries.end(), *name) != entries.end()) {
                tensor(k, *name);
              } else if (name && *name == "step" && step_dtype[flats[k].group]) {
                // A tensor of its own: the optimizer adds to each flat param's step in place.
                dcp::encode_tensor(wr, *step_dtype[flats[k].group], {}, std::to_string(out.storages.size()));
                out.storages.emplace_back(NewTensor{k, "step", *step_dtype[flats[k].group]});
              } else {
                OPTSTATE_RETURN_IF_ERROR(carry(fields.items[i + 1]));  // a step kept as a number
              }
            }
            wr.setitems_from_mark();
          }
          wr.setitems_from_mark();
        } else {
          return false;
        }
        return true;
      }));

  // The model states file: dp_world_size, and param_shapes per new flat param.
  const Ref dp_world = mp.dict_get(mp.root(), "dp_world_size");
  const Ref param_shapes = mp.dict_get(mp.root(), "param_shapes");
  std::map<std::string, Ref> size_of;  // param -> its torch.Size in the file
  for (const Ref d : mp.at(param_shapes).items)
    for (size_t i = 0; i + 1 < mp.at(d).items.size(); i += 2)
      if (const auto name = dcp::as_string(mp, mp.at(d).items[i])) size_of[*name] = mp.at(d).items[i + 1];
  Planner model_planner(mp, mw);
  OPTSTATE_ASSIGN_OR_RETURN(
      const Planned model_plan,
      model_planner.run([&](pickle::Writer& wr, Ref r, Planned& out, const Planner::Carry& carry) -> Result<bool> {
        for (size_t i = 0; i < frozen.size(); ++i)
          if (r == frozen[i].fragment) {
            dcp::encode_tensor(wr, frozen[i].dtype, {(frozen[i].numel + w - 1) / w}, std::to_string(out.storages.size()));
            out.storages.emplace_back(NewTensor{i, "frozen", frozen[i].dtype});
            return true;
          }
        if (r == dp_world) {
          wr.integer(w);
        } else if (r == param_shapes) {
          wr.empty_list();
          wr.mark();
          for (const Flat& f : flats) {
            wr.global("collections", "OrderedDict");
            wr.empty_tuple();
            wr.reduce();
            wr.mark();
            for (const auto& [name, shape] : f.params) {
              wr.str(name);
              OPTSTATE_RETURN_IF_ERROR(carry(size_of.at(name)));
            }
            wr.setitems_from_mark();
          }
          wr.appends_from_mark();
        } else {
          return false;
        }
        return true;
      }));

  const std::string optim_name = z->optim()[0].filename().string(), model_name = z->model().filename().string();
  if (model_name.find("zero_pp_rank_0_") == std::string::npos)
    return corrupt(mw + ": not a ZeRO-3 model states file name (zero_pp_rank_0_mp_rank_00_model_states.pt)");
  // The storages carried from rank 0's files (the same in every rank's), read and checked once.
  using Carried = std::vector<std::pair<std::string, std::vector<std::byte>>>;  // new key, bytes
  auto read_carried = [](const torchsave::Archive& from, const Planned& planned) -> Result<Carried> {
    Carried out;
    for (size_t key = 0; key < planned.storages.size(); ++key)
      if (const auto* old_key = std::get_if<std::string>(&planned.storages[key])) {
        OPTSTATE_ASSIGN_OR_RETURN(std::vector<std::byte> bytes, torchsave::read_storage(from, *old_key));
        out.emplace_back(std::to_string(key), std::move(bytes));
      }
    return out;
  };
  OPTSTATE_ASSIGN_OR_RETURN(const Carried optim_carried, read_carried(opt.first, optim_plan));
  OPTSTATE_ASSIGN_OR_RETURN(const Carried model_carried, read_carried(model.first, model_plan));
  auto carry_storages = [](const Carried& carried, dcp::ArchiveWriter& to) -> Status {
    for (const auto& [key, bytes] : carried) OPTSTATE_RETURN_IF_ERROR(to.storage(key, bytes));
    return Status::Ok();
  };

  // The model states files, one at a time: rank 0's values, the frozen params' partitions of each rank.
  for (int r = 0; r < world; ++r) {
    OPTSTATE_ASSIGN_OR_RETURN(OutputFile out, OutputFile::create(staging / rank_file(model_name, r)));
    dcp::ArchiveWriter archive(out);
    OPTSTATE_RETURN_IF_ERROR(archive.begin(std::as_bytes(std::span(model_plan.pkl))));
    OPTSTATE_RETURN_IF_ERROR(carry_storages(model_carried, archive));
    for (size_t key = 0; key < model_plan.storages.size(); ++key)
      if (const auto* t = std::get_if<NewTensor>(&model_plan.storages[key])) {
        const Frozen& fz = frozen[t->flat];  // this rank's partition of it, zero-padded
        const auto elem = static_cast<size_t>(dtype_size(fz.dtype));
        const int64_t part = (fz.numel + w - 1) / w, begin = std::min(fz.numel, r * part);
        const int64_t count = std::min(fz.numel, begin + part) - begin;
        std::vector<std::byte> bytes(static_cast<size_t>(part) * elem, std::byte{0});
        std::copy_n(fz.values.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(begin) * elem),
                    static_cast<size_t>(count) * elem, bytes.begin());
        OPTSTATE_RETURN_IF_ERROR(archive.storage(std::to_string(key), bytes));
      }
    OPTSTATE_RETURN_IF_ERROR(archive.finish().status());
    OPTSTATE_RETURN_IF_ERROR(out.sync_and_close());
  }

  // The optimizer files, up to kRanksAtOnce open together: each entry of each param is loaded once
  // per such batch and its parts streamed into the batch's ranks' partitions (the last ones
  // zero-padded, as DeepSpeed pads them). Each flat param's step: a tensor of its own.
  std::map<std::pair<size_t, std::string>, size_t> key_of;
  for (size_t key = 0; key < optim_plan.storages.size(); ++key)
    if (const auto* t = std::get_if<NewTensor>(&optim_plan.storages[key])) key_of[{t->flat, t->entry}] = key;
  for (int first = 0; first < world; first += torchsave::kRanksAtOnce) {
    const int batch = std::min(torchsave::kRanksAtOnce, world - first);
    torchsave::RankArchives archives;
    for (int r = first; r < first + batch; ++r) {
      OPTSTATE_RETURN_IF_ERROR(archives.open(staging / rank_file(optim_name, r), optim_plan.pkl));
      OPTSTATE_RETURN_IF_ERROR(carry_storages(optim_carried, archives[archives.size() - 1]));
    }
    for (size_t key = 0; key < optim_plan.storages.size(); ++key) {
      const auto* t = std::get_if<NewTensor>(&optim_plan.storages[key]);
      if (!t || t->entry != "step") continue;
      const int64_t step = state.params.at(flats[t->flat].params.at(0).first).step;  // every param of it has it
      const float f32 = static_cast<float>(step);
      const auto f64 = static_cast<double>(step);
      const std::span<const std::byte> bytes =
          t->dtype == DType::kF32 ? std::as_bytes(std::span(&f32, 1)) : std::as_bytes(std::span(&f64, 1));
      OPTSTATE_RETURN_IF_ERROR(archives.storage_to_all(std::to_string(key), bytes));
    }
    // Each rank's partition streamed into its file: the memory is one param's entry, not a flat's.
    static const std::vector<float> kZeros(4096, 0.0f);
    std::vector<float> scratch;  // 8-bit or half-precision entries widened (fp32 ones are written as loaded)
    for (size_t k = 0; k < flats.size(); ++k)
      for (const std::string& e : entries) {
        const auto key = key_of.find({k, e});
        if (key == key_of.end()) return corrupt(fmt::format("{}: no '{}' in the state of flat param {}", ow, e, k));
        for (size_t i = 0; i < archives.size(); ++i)
          OPTSTATE_RETURN_IF_ERROR(archives[i].begin_storage(std::to_string(key->second),
                                                             static_cast<uint64_t>(flats[k].length) * sizeof(float)));
        for (const auto& [name, shape] : flats[k].params) {
          const int64_t numel = *checked_numel(shape), part = (numel + w - 1) / w;
          OPTSTATE_ASSIGN_OR_RETURN(const Entry loaded, source.load(name, e));
          OPTSTATE_ASSIGN_OR_RETURN(const std::span<const float> values,
                                    entry_f32_span(loaded, numel, entry_key(name, e), scratch));
          for (int i = 0; i < batch; ++i) {
            const int64_t begin = std::min(numel, (first + i) * part), end = std::min(numel, begin + part);
            dcp::ArchiveWriter& archive = archives[static_cast<size_t>(i)];
            OPTSTATE_RETURN_IF_ERROR(archive.append(std::as_bytes(
                values.subspan(static_cast<size_t>(begin), static_cast<size_t>(end - begin)))));
            for (int64_t pad = part - (end - begin); pad > 0;) {  // the last parts: zero-padded
              const auto n = static_cast<size_t>(std::min<int64_t>(pad, static_cast<int64_t>(kZeros.size())));
              OPTSTATE_RETURN_IF_ERROR(archive.append(std::as_bytes(std::span(kZeros).first(n))));
              pad -= static_cast<int64_t>(n);
            }
          }
        }
        for (size_t i = 0; i < archives.size(); ++i) OPTSTATE_RETURN_IF_ERROR(archives[i].end_storage());
      }
    OPTSTATE_RETURN_IF_ERROR(archives.finish());
  }
  return fsync_directory(staging);
}

}  // namespace optstate::deepspeed
