// FSDP's per-rank files written again for another world size: what every rank of an FSDP2 (or FSDP1,
// flat parameters) run on `world` ranks would have saved (verl's optim_world_size_W_rank_R.pt, model_world_size_W_rank_R.pt
// and extra_state_world_size_W_rank_R.pt), which verl loads only on the world size it saved.
//
// Each rank's files are rank 0's, written again (Planner: pickle::emit with a hook), so the classes
// and fields are those of the torch that saved them. What depends on the world size is made anew:
// each DTensor's local tensor (rank r's rows of the global tensor, split as torch.chunk splits dim 0:
// FSDP2's Shard(0)), and in its device mesh the rank, its coordinate, the ranks and the layout's
// size; cached hashes are written as None, so torch computes them again. Every other value is
// carried as it was, tensors included (steps, buffers): their storages copied from rank 0's file.
// FSDP1's optimizer files hold plain 1-D parts of each unit's flat parameter instead of DTensors:
// each rank's part made anew from the unit's params in order, padded with zeros.
// Values come from the state being written (moments, weights); a DTensor the state does not hold
// (the weights of a frozen param, a tied weight's second name) is put together from the source's
// ranks' files. Byte layout and checks: FORMAT.md.
#include "torchsave_ranks.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <variant>

#include "dcp/dcp_layout.h"
#include "dcp/pickle.h"
#include "optstate/io.h"
#include "torchsave_archive.h"
#include "torchsave_layout.h"
#include "torchsave_planner.h"

namespace optstate::torchsave {
namespace {

using pickle::Kind;
using pickle::Pickle;
using pickle::Ref;

// A DTensor of rank 0's file: what it holds and where its parts sit in the pickle.
struct Dtensor {
  std::string fqn, entry;  // the state's entry; entry empty: not in the state (put together from the files)
  std::string key;         // a model file's key (for entry empty)
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  // global
  bool replicated = false;     // Replicate(): every rank holds all of it; else Shard(0)
};

// An FSDP1 optimizer file's part of a flat parameter's moment: unit (its optimizer param id) and entry.
struct FlatMoment {
  size_t unit = 0;
  std::string entry;
  DType dtype = DType::kF32;
};

// A storage of a new file: a DTensor's local part, FSDP1's part of a flat parameter's moment (index
// into each), or the device mesh's rank map (of `dtype`).
struct NewPart {
  enum class Kind { kDtensor, kFlat, kRankMap } kind = Kind::kDtensor;
  size_t index = 0;
  DType dtype = DType::kI32;
};
using Plan = Planned<NewPart>;

// A DeviceMesh's pickled state (its __dict__, in the fields of torch 2.4 to 2.15: FORMAT.md), found
// in rank 0's file and written anew for each rank: the whole dict, since the values that depend on
// the rank or the world size (_rank, _coordinate_on_dim, _flatten_rank_map, _layout, _rank_map;
// before torch 2.10 mesh, _flatten_mesh_list, _dim_group_infos) may be objects the pickle shares
// with others. A field optstate does not know is refused rather than
// carried, since it may hold the world size.
struct MeshFields {
  std::vector<std::pair<Ref, Ref>> items;  // (key, value) in the file's order
  std::vector<std::string> keys;
  Ref layout_class = pickle::kNoRef, layout_args = pickle::kNoRef, flat_class = pickle::kNoRef,
      flat_args = pickle::kNoRef;  // flat_*: kNoRef for a _MeshLayout with its own shape and stride
  DType rank_map_dtype = DType::kI32;  // of `_rank_map` (torch 2.10 and later) or `mesh` (before)
  bool coordinate_list = false;
  std::string group_tag, group_name;  // `_dim_group_infos`' one (tag, ranks, name), torch before 2.8
};

class FsdpWriter {
 public:
  FsdpWriter(StateSource& source, const CheckpointReader& reader, const FsdpSet& set, const fs::path& staging,
              int world)
      : source_(source), reader_(reader), set_(set), staging_(staging), world_(world),
        n_(static_cast<int64_t>(set.optim.size())) {}

  Status run() {
    const OptimizerState& state = source_.meta();
    // The state must be the source's: its params are laid out by the source's files.
    const OptimizerState& from = reader_.meta();
    for (const auto& [fqn, ps] : state.params) {
      const auto it = from.params.find(fqn);
      if (it == from.params.end())
        return invalid_argument(fmt::format("{}: param '{}' is not in the source's files; the per-rank files are "
                                            "written from the checkpoint they were read from", set_.dir.string(), fqn));
      if (it->second.step != ps.step)
        return invalid_argument(fmt::format("param '{}': step {}, the source's files hold {} (their step tensors are "
                                            "carried)", fqn, ps.step, it->second.step));
      for (const auto& [name, e] : ps.entries)
        if (e.encoding != Encoding::kDense)
          return invalid_argument(fmt::format("param '{}' '{}': 8-bit state; FSDP2's per-rank files are written for "
                                              "another world size with dense state only (torchao quantizes each "
                                              "rank's shard as its own tensor)", fqn, name));
    }
    if (state.params.size() != from.params.size())
      return invalid_argument(fmt::format("{}: the state has {} params, the source's files {}", set_.dir.string(),
                                          state.params.size(), from.params.size()));

    OPTSTATE_ASSIGN_OR_RETURN(auto optim0, open_archive(set_.optim[0]));
    OPTSTATE_ASSIGN_OR_RETURN(auto model0, open_archive(set_.model[0]));
    const std::string ow = set_.optim[0].string(), mw = set_.model[0].string();
    OPTSTATE_ASSIGN_OR_RETURN(const StateDict sd, interpret_state_dict(optim0.second, ow));
    OPTSTATE_ASSIGN_OR_RETURN(const ModelDict md, interpret_model_dict(model0.second, mw));

    // The optimizer file's DTensors: each param's moments; FSDP1's: each flat parameter's.
    Tables optim_tables;
    const bool flat = !set_.flat_units.empty();
    for (const ParamSpec& ps : sd.params) {
      if (!flat) continue;
      if (ps.id < 0 || static_cast<size_t>(ps.id) >= set_.flat_units.size())
        return corrupt(fmt::format("{}: flat parameter {} was not read", ow, ps.id));
      for (const auto& [name, es] : ps.entries) {
        const std::string ew = fmt::format("{} flat parameter {} '{}'", ow, ps.id, name);
        if (es.dtensor || es.encoding != Encoding::kDense || es.values.shape.size() != 1 ||
            !dcp::is_instance(optim0.second, es.ref, "torch._utils", "_rebuild_tensor_v2"))
          return corrupt(ew + ": not a plain 1-D tensor, as FSDP1 keeps a flat parameter's part");
        if (optim_tables.flat.count(es.ref)) return corrupt(ew + ": a tensor two moments share");
        optim_tables.flat.emplace(es.ref, flats_.size());
        flats_.push_back({static_cast<size_t>(ps.id), name, es.values.dtype});
      }
    }
    for (const ParamSpec& ps : sd.params) {
      if (flat) continue;
      if (ps.weight) return unsupported(ow + ": weights inside the optimizer's file; FSDP2's model files hold them");
      const auto fqn = set_.fqn_of_id.find(ps.id);
      if (fqn == set_.fqn_of_id.end()) return corrupt(fmt::format("{}: param {} was not read", ow, ps.id));
      for (const auto& [name, es] : ps.entries) {
        const std::string ew = fmt::format("{} param '{}' '{}'", ow, fqn->second, name);
        if (!es.dtensor) return unsupported(ew + ": not a DTensor");
        if (es.encoding != Encoding::kDense || es.fp8 || es.bits != 8)
          return unsupported(ew + ": 8-bit state (torchao); written for another world size only as dense state");
        OPTSTATE_RETURN_IF_ERROR(add_dtensor(optim0.second, es.ref, *es.dtensor, es.values.dtype, fqn->second, name, "",
                                             ew, optim_tables));
      }
    }
    // The model file's DTensors: the params' weights, and what the state does not hold.
    Tables model_tables;
    std::set<Ref> seen;
    for (const ModelTensor& t : md.tensors) {
      if (!t.dtensor || !seen.insert(t.ref).second) continue;  // buffers are carried; a tied weight once
      const std::string tw = fmt::format("{} ['{}']", mw, t.name);
      const std::string fqn = torch_param_fqn(t.name);  // the state's name of it
      const auto ps = state.params.find(fqn);
      const bool held = ps != state.params.end() && ps->second.entries.count(kParam);
      OPTSTATE_RETURN_IF_ERROR(add_dtensor(model0.second, t.ref, *t.dtensor, t.tensor.dtype, held ? fqn : "",
                                           held ? kParam : "", t.name, tw, model_tables));
    }
    // Every entry of the state has its place.
    std::set<std::pair<std::string, std::string>> placed;
    for (const Dtensor& d : dtensors_)
      if (!d.entry.empty()) placed.emplace(d.fqn, d.entry);
    for (const FlatMoment& f : flats_)
      for (const FsdpSet::FlatParam& fp : set_.flat_units[f.unit]) placed.emplace(fp.fqn, f.entry);
    for (const auto& [fqn, ps] : state.params)
      for (const auto& [name, e] : ps.entries)
        if (!placed.count({fqn, name}))
          return invalid_argument(fmt::format("param '{}' '{}' has no DTensor in {} or {}", fqn, name, ow, mw));

    const auto optim_name = rank_name(set_.optim[0].filename().string());
    const auto model_name = rank_name(set_.model[0].filename().string());
    if (!optim_name || !model_name) return corrupt(ow + ": not a per-rank file name");
    OPTSTATE_RETURN_IF_ERROR(write_files(optim0, optim_tables, *optim_name, ow));
    OPTSTATE_RETURN_IF_ERROR(write_files(model0, model_tables, *model_name, mw));
    return copy_others(*optim_name, *model_name);
  }

 private:
  // What the hook of one file replaces: local tensors (-> DTensor index), hashes, and each mesh's fields.
  struct Tables {
    std::map<Ref, size_t> local;  // -> dtensors_
    std::map<Ref, size_t> whole;  // FSDP1 on one rank: the DTensor objects, written as plain tensors
    std::map<Ref, size_t> flat;   // FSDP1's plain parts -> flats_
    std::set<Ref> hashes;
    std::map<Ref, MeshFields> meshes;  // by the mesh's fields dict
  };

  Status add_dtensor(const Pickle& p, Ref ref, const DTensorSpec& spec, DType dtype, const std::string& fqn,
                     const std::string& entry, const std::string& key, const std::string& where, Tables& t) {
    if (spec.placements.size() != 1 || spec.coordinate.size() != 1)
      return unsupported(fmt::format("{}: a DTensor on a {}-D device mesh; written for another world size on a 1-D "
                                     "mesh (FSDP2 without HSDP or tensor parallelism) only", where, spec.placements.size()));
    const Placement& pl = spec.placements[0];
    if (pl.kind == Placement::Kind::kShard && pl.dim != 0)
      return unsupported(fmt::format("{}: Shard({}); FSDP2 shards dim 0 (Shard(0)), which is what is written", where, pl.dim));
    if (spec.global_shape.empty() && pl.kind == Placement::Kind::kShard)
      return corrupt(where + ": a 0-d DTensor sharded");
    // _rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor, (...), (None, {"_local_tensor", "_spec"}))
    const pickle::Value& v = p.at(ref);
    const auto* args = v.args != pickle::kNoRef && p.at(v.args).kind == Kind::kTuple ? &p.at(v.args).items : nullptr;
    if (!args || args->size() != 4) return corrupt(where + ": not a DTensor's rebuild");
    Ref st = (*args)[3];
    if (p.at(st).kind == Kind::kTuple && p.at(st).items.size() == 2) st = p.at(st).items[1];
    const Ref local = p.dict_get(st, "_local_tensor"), spec_obj = p.dict_get(st, "_spec");
    if (local == pickle::kNoRef || spec_obj == pickle::kNoRef) return corrupt(where + ": without _local_tensor and _spec");
    if (!dcp::is_instance(p, local, "torch._utils", "_rebuild_tensor_v2"))
      return unsupported(where + ": its local part is not a plain tensor");
    const Ref spec_fields = dcp::fields_of(p, spec_obj);
    if (spec_fields == pickle::kNoRef) return corrupt(where + ": a DTensorSpec without fields");
    if (const Ref h = p.dict_get(spec_fields, "_hash"); h != pickle::kNoRef) t.hashes.insert(h);
    const Ref mesh = p.dict_get(spec_fields, "mesh");
    if (mesh == pickle::kNoRef) return corrupt(where + ": a DTensorSpec without its mesh");
    if (const Ref mf = dcp::fields_of(p, mesh); mf == pickle::kNoRef || !t.meshes.count(mf)) {
      OPTSTATE_ASSIGN_OR_RETURN(MeshFields fields, mesh_fields(p, mesh, where));
      t.meshes.emplace(dcp::fields_of(p, mesh), std::move(fields));
    }
    if (t.local.count(local)) return corrupt(where + ": a local tensor two DTensors share");
    t.local.emplace(local, dtensors_.size());
    t.whole.emplace(ref, dtensors_.size());
    dtensors_.push_back({fqn, entry, key, dtype, spec.global_shape, pl.kind == Placement::Kind::kReplicate});
    return Status::Ok();
  }

  Result<MeshFields> mesh_fields(const Pickle& p, Ref mesh, const std::string& where) {
    const std::string mw = where + " device mesh";
    const Ref f = dcp::fields_of(p, mesh);
    if (!dcp::is_instance(p, mesh, "torch.distributed.device_mesh", "DeviceMesh") || f == pickle::kNoRef ||
        p.at(f).kind != Kind::kDict)
      return corrupt(mw + ": not a pickled DeviceMesh");
    MeshFields out;
    const auto& items = p.at(f).items;
    auto ints = [&](Ref r) { return dcp::int_tuple(p, r); };
    auto all_ranks = [&](Ref r) {  // the ints 0..n-1 in order: a 1-D mesh over every rank
      const auto ranks = ints(r);
      bool in_order = ranks && static_cast<int64_t>(ranks->size()) == n_;
      for (int64_t i = 0; in_order && i < n_; ++i) in_order = (*ranks)[static_cast<size_t>(i)] == i;
      return in_order;
    };
    // Two generations: torch 2.10 and later pickle `_rank_map` and `_layout`; before, the ranks are
    // the tensor `mesh` and the tuple `_flatten_mesh_list` (with `_dim_group_infos`, before 2.8).
    bool before_layout = false;
    for (size_t k = 0; k + 1 < items.size(); k += 2) before_layout |= dcp::as_string(p, items[k]) == "mesh";
    std::set<std::string> needed = before_layout ? std::set<std::string>{"mesh", "_coordinate_on_dim", "_flatten_mesh_list"}
                                                 : std::set<std::string>{"_coordinate_on_dim", "_flatten_rank_map",
                                                                         "_layout", "_rank_map"};  // `_rank`: 2.11 on
    for (size_t k = 0; k + 1 < items.size(); k += 2) {
      const auto key = dcp::as_string(p, items[k]);
      const Ref val = items[k + 1];
      if (!key) return corrupt(mw + ": a field without a name");
      out.items.emplace_back(items[k], val);
      out.keys.push_back(*key);
      needed.erase(*key);
      if (*key == "_device_type" || *key == "_mesh_dim_names" || *key == "_thread_id" || *key == "_dim_group_names" ||
          *key == "_hash" || (before_layout && (*key == "device_type" || *key == "mesh_dim_names"))) {
        continue;  // the same on every rank and world size (one group: the default one's name); the hash recomputed
      } else if (*key == "_root_mesh" || *key == "_parent_mesh") {
        if (p.at(val).kind != Kind::kNone) return unsupported(fmt::format("{}: a sub-mesh of a larger mesh ({})", mw, *key));
      } else if (*key == "_flatten_mapping") {
        if (!p.at(val).items.empty()) return unsupported(mw + ": flattened sub-meshes (_flatten_mapping)");
      } else if (*key == "_preserve_rank_order") {  // torch 2.15 on: how groups are made, not which ranks
        if (p.at(val).kind != Kind::kBool) return unsupported(mw + ": a '_preserve_rank_order' that is not a bool");
      } else if (*key == "_rank") {
        if (p.at(val).kind != Kind::kInt || p.at(val).i != 0) return corrupt(mw + ": '_rank' is not rank 0's");
      } else if (*key == "_coordinate_on_dim") {
        if (ints(val) != std::vector<int64_t>{0}) return corrupt(mw + ": '_coordinate_on_dim' is not rank 0's on a 1-D mesh");
        out.coordinate_list = p.at(val).kind == Kind::kList;
      } else if (*key == "_flatten_rank_map" || (before_layout && *key == "_flatten_mesh_list")) {
        if (!all_ranks(val))
          return unsupported(fmt::format("{}: its ranks are not 0..{} in order (a mesh over some ranks only)", mw, n_ - 1));
      } else if (*key == "_layout") {
        // torch 2.13 and later: _MeshLayout{axes: (_FlatLayout{shape: (N,), stride: (1,)},)};
        // 2.10 to 2.12: _MeshLayout{shape: (N,), stride: (1,)}. Written back in the file's form.
        const pickle::Value& lv = p.at(val);
        const Ref lf = dcp::fields_of(p, val);
        const Ref axes = lf == pickle::kNoRef ? pickle::kNoRef : p.dict_get(lf, "axes");
        const pickle::Value* ax = axes == pickle::kNoRef ? nullptr : &p.at(axes);
        const Ref flat_obj = ax && ax->kind == Kind::kTuple && ax->items.size() == 1 ? ax->items[0] : pickle::kNoRef;
        const Ref flat = axes == pickle::kNoRef ? lf : flat_obj == pickle::kNoRef ? pickle::kNoRef : dcp::fields_of(p, flat_obj);
        const bool axes_form_ok = axes == pickle::kNoRef ||
                                  (flat != pickle::kNoRef && p.at(lf).items.size() == 2 &&
                                   dcp::is_instance(p, flat_obj, "torch.distributed._mesh_layout", "_FlatLayout") &&
                                   p.at(flat_obj).newobj);
        if (!dcp::is_instance(p, val, "torch.distributed._mesh_layout", "_MeshLayout") || !lv.newobj ||
            flat == pickle::kNoRef || !axes_form_ok || p.at(flat).kind != Kind::kDict || p.at(flat).items.size() != 4 ||
            p.dict_get(flat, "shape") == pickle::kNoRef || p.dict_get(flat, "stride") == pickle::kNoRef)
          return unsupported(mw + ": a '_layout' optstate does not know (a 1-D _MeshLayout: its shape and stride, "
                                  "or one _FlatLayout's)");
        if (ints(p.dict_get(flat, "shape")) != layout_of(n_, axes != pickle::kNoRef) ||
            ints(p.dict_get(flat, "stride")) != layout_of(1, axes != pickle::kNoRef && n_ == 1))
          return unsupported(fmt::format("{}: a '_layout' other than a 1-D mesh of {} rank{} in order", mw, n_,
                                         n_ == 1 ? "" : "s"));
        out.layout_class = lv.callable;
        out.layout_args = lv.args;
        if (axes != pickle::kNoRef) {
          out.flat_class = p.at(flat_obj).callable;
          out.flat_args = p.at(flat_obj).args;
        }
      } else if (*key == "_rank_map" || (before_layout && *key == "mesh")) {
        OPTSTATE_ASSIGN_OR_RETURN(const dcp::Payload pl, dcp::interpret_value(p, val, fmt::format("{} '{}'", mw, *key)));
        if (pl.kind != dcp::Payload::Kind::kTensor || pl.tensor.shape != std::vector<int64_t>{n_} ||
            (pl.tensor.dtype != DType::kI32 && pl.tensor.dtype != DType::kI64))
          return unsupported(fmt::format("{}: a '{}' other than {} integers", mw, *key, n_));
        out.rank_map_dtype = pl.tensor.dtype;
      } else if (before_layout && *key == "_dim_group_infos") {
        // [(tag, ranks, group name)]: the one group of a 1-D mesh, over ranks 0..n-1
        const pickle::Value& v = p.at(val);
        const pickle::Value* info = v.kind == Kind::kList && v.items.size() == 1 ? &p.at(v.items[0]) : nullptr;
        const auto tag = info && info->kind == Kind::kTuple && info->items.size() == 3 ? dcp::as_string(p, info->items[0])
                                                                                        : std::nullopt;
        const auto name = tag ? dcp::as_string(p, info->items[2]) : std::nullopt;
        if (!name || !all_ranks(info->items[1]))
          return unsupported(fmt::format("{}: a '_dim_group_infos' other than one group over ranks 0..{}", mw, n_ - 1));
        out.group_tag = *tag;
        out.group_name = *name;
      } else {
        return unsupported(fmt::format("{}: field '{}', which optstate does not know; a DeviceMesh pickled by another "
                                       "torch than the ones optstate writes for (2.4 to 2.15)", mw, *key));
      }
    }
    if (!needed.empty())
      return unsupported(fmt::format("{}: without '{}', a field of torch's DeviceMesh", mw, *needed.begin()));
    return out;
  }

  // A 1-D mesh layout's shape (n,), or its stride (1,) as layout_of(1, ...). torch 2.13 and later
  // pickle a mesh of one rank with an empty one (its size-1 mode dropped; `dropped`), and refuse
  // the (1,) form as another mesh; 2.10-2.12 keep (1,).
  static std::vector<int64_t> layout_of(int64_t n, bool dropped) {
    return n == 1 && dropped ? std::vector<int64_t>{} : std::vector<int64_t>{n};
  }

  // A mesh's fields for rank r of world_ ranks: the file's, with those of the rank and world size anew.
  Status write_mesh_fields(pickle::Writer& w, const MeshFields& mf, int r, Plan& out,
                           const Planner<NewPart>::Carry& carry) {
    auto int_seq = [&](const std::vector<int64_t>& v, bool list) {
      if (list) {
        w.empty_list();
        if (v.empty()) return;
        w.mark();
        for (int64_t x : v) w.integer(x);
        w.appends_from_mark();
        return;
      }
      w.mark();
      for (int64_t x : v) w.integer(x);
      w.tuple_from_mark();
    };
    std::vector<int64_t> all(static_cast<size_t>(world_));
    for (int i = 0; i < world_; ++i) all[static_cast<size_t>(i)] = i;
    w.empty_dict();
    w.mark();
    for (size_t i = 0; i < mf.items.size(); ++i) {
      const std::string& key = mf.keys[i];
      OPTSTATE_RETURN_IF_ERROR(carry(mf.items[i].first));
      if (key == "_rank") {
        w.integer(r);
      } else if (key == "_coordinate_on_dim") {
        int_seq({r}, mf.coordinate_list);
      } else if (key == "_flatten_rank_map" || key == "_flatten_mesh_list") {
        int_seq(all, false);
      } else if (key == "_dim_group_infos") {
        w.empty_list();
        w.mark();
        w.mark();
        w.str(mf.group_tag);
        int_seq(all, true);
        w.str(mf.group_name);
        w.tuple_from_mark();
        w.appends_from_mark();
      } else if (key == "_hash") {
        w.none();  // computed again when first needed
      } else if (key == "_rank_map" || key == "mesh") {
        dcp::encode_tensor(w, mf.rank_map_dtype, {world_}, std::to_string(out.storages.size()));
        out.storages.emplace_back(NewPart{NewPart::Kind::kRankMap, 0, mf.rank_map_dtype});
      } else if (key == "_layout") {
        const bool axes = mf.flat_class != pickle::kNoRef;
        auto shape_and_stride = [&] {
          w.empty_dict();
          w.mark();
          w.str("shape");
          int_seq(layout_of(world_, axes), false);
          w.str("stride");
          int_seq(layout_of(1, axes && world_ == 1), false);
          w.setitems_from_mark();
          w.build();
        };
        OPTSTATE_RETURN_IF_ERROR(carry(mf.layout_class));
        OPTSTATE_RETURN_IF_ERROR(carry(mf.layout_args));
        w.newobj();
        if (!axes) {
          shape_and_stride();
        } else {
          w.empty_dict();
          w.mark();
          w.str("axes");
          w.mark();
          OPTSTATE_RETURN_IF_ERROR(carry(mf.flat_class));
          OPTSTATE_RETURN_IF_ERROR(carry(mf.flat_args));
          w.newobj();
          shape_and_stride();
          w.tuple_from_mark();
          w.setitems_from_mark();
          w.build();
        }
      } else {
        OPTSTATE_RETURN_IF_ERROR(carry(mf.items[i].second));
      }
    }
    w.setitems_from_mark();
    return Status::Ok();
  }

  // Rank r's rows of a DTensor: [begin, end) of dim 0, as torch.chunk splits it in world_ pieces.
  std::pair<int64_t, int64_t> rows(const Dtensor& d, int r) const {
    if (d.replicated) return {0, d.shape.empty() ? 1 : d.shape[0]};
    const int64_t n = d.shape[0], chunk = (n + world_ - 1) / world_;
    const int64_t begin = std::min(n, r * chunk);
    return {begin, std::min(n, begin + chunk)};
  }

  std::vector<int64_t> local_shape(const Dtensor& d, int r) const {
    if (d.replicated) return d.shape;
    std::vector<int64_t> s = d.shape;
    const auto [b, e] = rows(d, r);
    s[0] = e - b;
    return s;
  }

  Result<Plan> plan(const Pickle& p, const Tables& t, int r, const std::string& where) {
    Planner<NewPart> planner(p, where);
    return planner.run([&](pickle::Writer& w, Ref ref, Plan& out, const Planner<NewPart>::Carry& carry) -> Result<bool> {
      // FSDP1 on one rank shards nothing: its sharded state_dict holds plain tensors, and it loads only those.
      if (const auto it = t.whole.find(ref); it != t.whole.end() && world_ == 1 && !set_.flat_units.empty()) {
        const Dtensor& d = dtensors_[it->second];
        dcp::encode_tensor(w, d.dtype, d.shape, std::to_string(out.storages.size()));
        out.storages.emplace_back(NewPart{NewPart::Kind::kDtensor, it->second, d.dtype});
        return true;
      }
      if (const auto it = t.local.find(ref); it != t.local.end()) {
        const Dtensor& d = dtensors_[it->second];
        dcp::encode_tensor(w, d.dtype, local_shape(d, r), std::to_string(out.storages.size()));
        out.storages.emplace_back(NewPart{NewPart::Kind::kDtensor, it->second, d.dtype});
        return true;
      }
      if (const auto it = t.flat.find(ref); it != t.flat.end()) {
        const FlatMoment& f = flats_[it->second];
        dcp::encode_tensor(w, f.dtype, {flat_part(f.unit)}, std::to_string(out.storages.size()));
        out.storages.emplace_back(NewPart{NewPart::Kind::kFlat, it->second, f.dtype});
        return true;
      }
      if (t.hashes.count(ref)) {
        w.none();  // computed again when first needed
        return true;
      }
      if (const auto it = t.meshes.find(ref); it != t.meshes.end()) {
        OPTSTATE_RETURN_IF_ERROR(write_mesh_fields(w, it->second, r, out, carry));
        return true;
      }
      return false;
    });
  }

  // The source's rank r's model file, opened and interpreted once (for every DTensor assemble() puts together).
  struct SourceModel {
    Archive archive;
    ModelDict dict;
  };
  Result<const SourceModel*> source_model(size_t r) {
    if (source_models_.empty()) source_models_.resize(set_.model.size());
    if (!source_models_[r]) {
      const fs::path& file = set_.model[r];
      OPTSTATE_ASSIGN_OR_RETURN(auto ap, open_archive(file));
      OPTSTATE_ASSIGN_OR_RETURN(ModelDict md, interpret_model_dict(ap.second, file.string()));
      source_models_[r] = std::make_unique<SourceModel>(SourceModel{std::move(ap.first), std::move(md)});
    }
    return source_models_[r].get();
  }

  // The global values of a DTensor the state does not hold, put together from the source's ranks'
  // model files (each rank's local tensor where its coordinate puts it).
  Result<std::vector<std::byte>> assemble(const Dtensor& d) {
    OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(d.shape));
    const size_t elem = dtype_size(d.dtype);
    std::vector<std::byte> out(static_cast<size_t>(numel) * elem);
    const int64_t row = d.shape.empty() || d.shape[0] == 0 ? 0 : numel / d.shape[0];
    for (int64_t r = 0; r < (d.replicated ? 1 : n_); ++r) {
      const fs::path& file = set_.model[static_cast<size_t>(r)];
      OPTSTATE_ASSIGN_OR_RETURN(const SourceModel* m, source_model(static_cast<size_t>(r)));
      const ModelTensor* t = m->dict.find(d.key);
      const std::string tw = fmt::format("{} ['{}']", file.string(), d.key);
      if (!t || !t->dtensor || t->tensor.dtype != d.dtype || t->dtensor->global_shape != d.shape)
        return corrupt(tw + ": not the DTensor rank 0's model file has");
      OPTSTATE_ASSIGN_OR_RETURN(const Box box, dtensor_box(*t->dtensor, {n_}, tw));
      OPTSTATE_ASSIGN_OR_RETURN(const int64_t local, checked_numel(t->tensor.shape));
      if (t->tensor.shape != box.sizes) return corrupt(tw + ": its local tensor is not its rows");
      OPTSTATE_ASSIGN_OR_RETURN(const std::vector<std::byte> storage, read_storage(m->archive, t->tensor.storage_key));
      const uint64_t at = static_cast<uint64_t>(t->tensor.offset) * elem, bytes = static_cast<uint64_t>(local) * elem;
      if (t->tensor.offset < 0 || at > storage.size() || storage.size() - at < bytes)
        return corrupt(tw + ": its local tensor lies outside its storage");
      const uint64_t dst = static_cast<uint64_t>(box.offsets.empty() ? 0 : box.offsets[0] * row) * elem;
      std::memcpy(out.data() + dst, storage.data() + at, bytes);
    }
    return out;
  }

  Status write_files(const std::pair<Archive, Pickle>& source, const Tables& t, const RankName& name,
                     const std::string& where) {
    std::vector<Plan> plans;
    for (int r = 0; r < world_; ++r) {
      OPTSTATE_ASSIGN_OR_RETURN(Plan pl, plan(source.second, t, r, where));
      if (!plans.empty() && pl.storages.size() != plans[0].storages.size())
        return internal_error(where + ": ranks' files with different storages");
      plans.push_back(std::move(pl));
    }
    const std::string prefix = new_prefix(name.prefix);
    for (int first = 0; first < world_; first += kRanksAtOnce) {
      const int batch = std::min(kRanksAtOnce, world_ - first);
      RankArchives archives;
      for (int r = first; r < first + batch; ++r)
        OPTSTATE_RETURN_IF_ERROR(archives.open(staging_ / fmt::format("{}{}{}", prefix, r, name.ext),
                                               plans[static_cast<size_t>(r)].pkl));
      // Storages in key order, each loaded once for the batch.
      for (size_t key = 0; key < plans[0].storages.size(); ++key) {
        const std::string k = std::to_string(key);
        const auto& s = plans[0].storages[key];
        if (const auto* old_key = std::get_if<std::string>(&s)) {
          OPTSTATE_ASSIGN_OR_RETURN(const std::vector<std::byte> bytes, read_storage(source.first, *old_key));
          OPTSTATE_RETURN_IF_ERROR(archives.storage_to_all(k, bytes));
          continue;
        }
        const NewPart& part = std::get<NewPart>(s);
        if (part.kind == NewPart::Kind::kFlat) {
          OPTSTATE_RETURN_IF_ERROR(write_flat(flats_[part.index], k, first, archives));
          OPTSTATE_RETURN_IF_ERROR(check_interrupt(staging_));
          continue;
        }
        if (part.kind == NewPart::Kind::kRankMap) {
          std::vector<std::byte> bytes(static_cast<size_t>(world_) * dtype_size(part.dtype));
          for (int i = 0; i < world_; ++i) {
            const int64_t v64 = i;
            const auto v32 = static_cast<int32_t>(i);
            if (part.dtype == DType::kI64) std::memcpy(bytes.data() + static_cast<size_t>(i) * 8, &v64, 8);
            else std::memcpy(bytes.data() + static_cast<size_t>(i) * 4, &v32, 4);
          }
          OPTSTATE_RETURN_IF_ERROR(archives.storage_to_all(k, bytes));
          continue;
        }
        const Dtensor& d = dtensors_[part.index];
        Entry loaded;
        std::vector<std::byte> assembled;
        std::span<const std::byte> values;
        if (!d.entry.empty()) {
          OPTSTATE_ASSIGN_OR_RETURN(loaded, source_.load(d.fqn, d.entry));
          if (loaded.dtype != d.dtype)
            return invalid_argument(fmt::format("param '{}' '{}': {} values where the source's files hold {}", d.fqn,
                                                d.entry, dtype_name(loaded.dtype), dtype_name(d.dtype)));
          values = loaded.values.span();
        } else {
          OPTSTATE_ASSIGN_OR_RETURN(assembled, assemble(d));
          values = assembled;
        }
        OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(d.shape));
        const size_t row_bytes = d.shape.empty() || d.shape[0] == 0
                                     ? 0
                                     : static_cast<size_t>(numel / d.shape[0]) * dtype_size(d.dtype);
        if (values.size() != static_cast<size_t>(numel) * dtype_size(d.dtype))
          return internal_error(fmt::format("{} '{}': {} bytes for {} elements", d.fqn, d.entry, values.size(), numel));
        for (int i = 0; i < batch; ++i) {
          const auto [b, e] = rows(d, first + i);
          const auto part_bytes = d.replicated ? values : values.subspan(static_cast<size_t>(b) * row_bytes,
                                                                         static_cast<size_t>(e - b) * row_bytes);
          OPTSTATE_RETURN_IF_ERROR(archives[static_cast<size_t>(i)].storage(k, part_bytes));
        }
        OPTSTATE_RETURN_IF_ERROR(check_interrupt(staging_));
      }
      OPTSTATE_RETURN_IF_ERROR(archives.finish());
    }
    return Status::Ok();
  }

  // FSDP1: the elements of unit u's flat parameter each rank holds on world_ ranks (FSDP pads the
  // flat parameter to world_ * that).
  int64_t flat_part(size_t u) const {
    int64_t total = 0;
    for (const FsdpSet::FlatParam& fp : set_.flat_units[u]) total += fp.numel;
    return (total + world_ - 1) / world_;
  }

  // FSDP1: one moment of a flat parameter, each rank's part streamed into its file from the params in
  // order, one param's entry in memory at a time; past the params, zeros (FSDP's padding).
  Status write_flat(const FlatMoment& f, const std::string& key, int first, RankArchives& archives) {
    const int64_t part = flat_part(f.unit);
    const auto elem = static_cast<int64_t>(dtype_size(f.dtype));
    for (size_t i = 0; i < archives.size(); ++i)
      OPTSTATE_RETURN_IF_ERROR(archives[i].begin_storage(key, static_cast<uint64_t>(part * elem)));
    std::vector<int64_t> filled(archives.size(), 0);
    int64_t at = 0;
    for (const FsdpSet::FlatParam& fp : set_.flat_units[f.unit]) {
      OPTSTATE_ASSIGN_OR_RETURN(const Entry e, source_.load(fp.fqn, f.entry));
      if (e.encoding != Encoding::kDense || e.dtype != f.dtype ||
          e.values.size != static_cast<size_t>(fp.numel * elem))
        return invalid_argument(fmt::format("param '{}' '{}': not {} values of its {} elements, as its flat parameter "
                                            "holds them", fp.fqn, f.entry, dtype_name(f.dtype), fp.numel));
      const std::span<const std::byte> values = e.values.span();
      for (size_t i = 0; i < archives.size(); ++i) {
        const int64_t r = first + static_cast<int64_t>(i);
        const int64_t lo = std::max(at, r * part), hi = std::min(at + fp.numel, (r + 1) * part);
        if (lo >= hi) continue;
        OPTSTATE_RETURN_IF_ERROR(archives[i].append(
            values.subspan(static_cast<size_t>((lo - at) * elem), static_cast<size_t>((hi - lo) * elem))));
        filled[i] += hi - lo;
      }
      at += fp.numel;
    }
    static const std::vector<std::byte> kZeros(size_t{1} << 16);
    for (size_t i = 0; i < archives.size(); ++i) {
      for (int64_t left = (part - filled[i]) * elem; left > 0;) {
        const auto n = std::min<int64_t>(left, static_cast<int64_t>(kZeros.size()));
        OPTSTATE_RETURN_IF_ERROR(archives[i].append(std::span(kZeros).first(static_cast<size_t>(n))));
        left -= n;
      }
      OPTSTATE_RETURN_IF_ERROR(archives[i].end_storage());
    }
    return Status::Ok();
  }

  // A per-rank name's prefix for the new world size: "..._world_size_<N>_..." says <world>.
  std::string new_prefix(const std::string& prefix) const {
    const std::string from = fmt::format("world_size_{}_", n_), to = fmt::format("world_size_{}_", world_);
    std::string out = prefix;
    if (const auto at = out.find(from); at != std::string::npos) out.replace(at, from.size(), to);
    return out;
  }

  // What else the folder holds: other per-rank files (verl's extra_state_*: the LR scheduler, RNG
  // states) for each new rank from the source rank r % N; fsdp_config.json with the new world size;
  // the rest (huggingface/) copied as it is.
  Status copy_others(const RankName& optim, const RankName& model) {
    std::error_code ec;
    for (fs::directory_iterator it(set_.dir, ec), end; !ec && it != end; it.increment(ec)) {
      const fs::path from = it->path();
      const std::string name = from.filename().string();
      if (name.empty() || name[0] == '.') continue;  // hidden: another writer's staging, say
      const auto rn = it->is_regular_file(ec) ? rank_name(name) : std::nullopt;
      if (rn && ((rn->prefix == optim.prefix && rn->ext == optim.ext) || (rn->prefix == model.prefix && rn->ext == model.ext)))
        continue;
      if (rn && rn->prefix.find(fmt::format("world_size_{}_", n_)) != std::string::npos) {
        if (rn->rank != 0) continue;  // copied once per new rank, from rank 0's name
        for (int r = 0; r < world_; ++r) {
          const fs::path src = set_.dir / fmt::format("{}{}{}", rn->prefix, r % n_, rn->ext);
          OPTSTATE_RETURN_IF_ERROR(copy_file_durably(src, staging_ / fmt::format("{}{}{}", new_prefix(rn->prefix), r, rn->ext)));
        }
        continue;
      }
      if (name == "fsdp_config.json" && it->is_regular_file(ec)) {
        OPTSTATE_RETURN_IF_ERROR(write_fsdp_config(from));
        continue;
      }
      OPTSTATE_RETURN_IF_ERROR(copy_entry_as_is(from, staging_ / name));
    }
    if (ec) return io_error(fmt::format("{}: {}", set_.dir.string(), ec.message()));
    return Status::Ok();
  }

  // verl's {"FSDP_version": 2, "world_size": N}: the new world size, the rest as it was.
  Status write_fsdp_config(const fs::path& from) {
    OPTSTATE_ASSIGN_OR_RETURN(InputFile in, InputFile::open(from));
    if (in.size() > (uint64_t{1} << 20)) return corrupt(from.string() + ": over 1 MiB");
    std::string text(static_cast<size_t>(in.size()), '\0');
    OPTSTATE_RETURN_IF_ERROR(in.read_at(0, std::as_writable_bytes(std::span(text))).with_context(from.string()));
    const std::string key = "\"world_size\"";
    const auto at = text.find(key);
    size_t colon = at == std::string::npos ? at : text.find(':', at + key.size());
    size_t digits = colon == std::string::npos ? colon : text.find_first_not_of(" \t\r\n", colon + 1);
    size_t end = digits;
    while (end != std::string::npos && end < text.size() && std::isdigit(static_cast<unsigned char>(text[end]))) ++end;
    if (digits == std::string::npos || end == digits || text.find(key, at + 1) != std::string::npos)
      return corrupt(from.string() + ": no one \"world_size\": <number> in it");
    text.replace(digits, end - digits, std::to_string(world_));
    return write_small_file(staging_ / from.filename(), std::as_bytes(std::span(text)));
  }

  StateSource& source_;
  const CheckpointReader& reader_;
  const FsdpSet& set_;
  fs::path staging_;
  int world_;
  int64_t n_;  // the source's world size
  std::vector<Dtensor> dtensors_;
  std::vector<FlatMoment> flats_;
  std::vector<std::unique_ptr<SourceModel>> source_models_;  // by source rank, as assemble() needs them
};

}  // namespace

Status write_fsdp_ranks(StateSource& source, const CheckpointReader& reader, const FsdpSet& set,
                         const fs::path& staging, int world) {
  if (world < 1 || world > 65536) return invalid_argument(fmt::format("world size {} out of range", world));
  FsdpWriter w(source, reader, set, staging, world);
  return w.run();
}

}  // namespace optstate::torchsave
