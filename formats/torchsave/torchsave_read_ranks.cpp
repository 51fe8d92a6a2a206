// The torch.save reader's per-rank sets: FSDP1's flat-parameter parts (init_fsdp1) and the rank
// files of nanotron and Megatron-LM's legacy checkpoints (init_rank_files); FSDP2's DTensor files are
// read by init (torchsave_format.cpp). Layout: FORMAT.md.
#include "torchsave/torchsave_reader_impl.h"

namespace optstate::torchsave::detail {

auto TorchSaveReader::init_rank_files(const RankFileSet& np) -> Status {
  nanotron_ = !np.megatron;
  megatron_ = np.megatron;
  set_ = true;
  const std::string dir = np.dir.string();
  std::vector<StateDict> sds;
  std::set<std::string> unread;
  size_t megatron_others = 0;      // Megatron's model dicts' entries beside the weights read, every stage's
  std::string megatron_others_key;  // ... and where they are ("['model']")
  for (const RankFileSet::File& f : np.files) {
    const std::string fw = f.path.string();
    StateDict sd;
    if (!f.distrib.empty()) {
      OPTSTATE_ASSIGN_OR_RETURN(sd, megatron_distributed_state(f));
    } else {
      OPTSTATE_ASSIGN_OR_RETURN(auto ap, open_archive(f.path));
      if (np.megatron && ap.second.dict_get(ap.second.root(), "optimizer") == pickle::kNoRef)
        return corrupt(fw + ": Megatron's trainer dict without 'optimizer' (saved with --no-save-optim, or a "
                            "release of the weights alone): no optimizer state to read");
      if (const auto a = np.megatron ? megatron_args_of(ap.second) : std::nullopt; a && a->distributed_optimizer.value_or(false))
        return corrupt(fmt::format("{}: its args say use_distributed_optimizer True, and no distrib_optim.pt (the "
                                   "distributed optimizer's state) is beside it", fw));
      files_.push_back(std::move(ap.first));
      OPTSTATE_ASSIGN_OR_RETURN(sd, interpret_state_dict(ap.second, fw));
    }
    if (np.megatron) {
      // Megatron's trainer dict: the optimizer's at ['optimizer'] (its plain optimizer) or
      // ['optimizer']['optimizer'] (mixed precision), every stepped param named by the model dict
      if (sd.optimizer_path.empty() || sd.per_param || sd.libtorch || sd.nanotron || sd.model_ref == pickle::kNoRef)
        return corrupt(fmt::format("{}: not Megatron's model_optim_rng.pt (the optimizer's state_dict beside the "
                                   "model's)", fw));
      if (sd.megatron_args) {
        const auto& a = *sd.megatron_args;
        if (a.tp_size && *a.tp_size != np.megatron_ranks)
          return corrupt(fmt::format("{}: its args say tensor_model_parallel_size {}; {} holds {} tensor-parallel "
                                     "rank{}", fw, *a.tp_size, dir, np.megatron_ranks,
                                     np.megatron_ranks == 1 ? "" : "s"));
        if (a.distributed_optimizer && !*a.distributed_optimizer && !f.distrib.empty())
          return corrupt(fmt::format("{}: its args say use_distributed_optimizer False, and a distrib_optim.pt is "
                                     "beside it", fw));
        if (a.ep_size && *a.ep_size != np.megatron_experts)
          return corrupt(fmt::format("{}: its args say expert_model_parallel_size {}; {} holds {} expert-parallel "
                                     "rank{}", fw, *a.ep_size, dir, np.megatron_experts,
                                     np.megatron_experts == 1 ? "" : "s"));
        if (a.etp_size && *a.etp_size != a.tp_size.value_or(1) && a.num_experts.value_or(0) > 0)
          return unsupported(fmt::format("{}: its args say expert_tensor_parallel_size {} beside "
                                         "tensor_model_parallel_size {}: the experts split over other ranks than "
                                         "the dense layers, which optstate does not read", fw, *a.etp_size,
                                         a.tp_size.value_or(1)));
        if (a.vp_size.value_or(1) > 1 && sd.megatron_chunks != static_cast<size_t>(*a.vp_size))
          return corrupt(fmt::format("{}: its args say virtual_pipeline_model_parallel_size {}, and it holds {} model "
                                     "chunk{} (model0, model1, ...)", fw, *a.vp_size, sd.megatron_chunks,
                                     sd.megatron_chunks == 1 ? "" : "s"));
        if (a.pp_size && *a.pp_size != np.megatron_stages)
          return corrupt(fmt::format("{}: its args say pipeline_model_parallel_size {}; {} holds {} pipeline "
                                     "stage{}", fw, *a.pp_size, dir, np.megatron_stages,
                                     np.megatron_stages == 1 ? "" : "s"));
      }
      for (const ParamSpec& spec : sd.params)
        if (!spec.entries.empty() && !sd.model_weight_keys.count(spec.fqn))
          return corrupt(fmt::format("{}: param {} of the optimizer is not placed among the model's tensors{}", fw,
                                     spec.fqn, sd.not_read.empty() ? "" : " (" + sd.not_read.back() + ")"));
      // a pipeline stage's layers numbered on from the stages before it, an expert rank's experts
      // from its first
      const auto off = np.layer_offsets.find(f.pp);
      if (off != np.layer_offsets.end() || f.expert_offset || np.megatron_chunked) {
        auto global = [&](const std::string& name) {
          return megatron::global_name(name, off == np.layer_offsets.end() ? nullptr : &off->second, f.expert_offset,
                                       np.megatron_chunked);
        };
        for (ParamSpec& spec : sd.params) spec.fqn = global(spec.fqn);
        for (GroupSpec& g : sd.groups)
          for (std::string& n : g.params) n = global(n);
      }
    } else if (!sd.nanotron || !sd.optimizer_path.empty() || sd.per_param || sd.libtorch) {
      return corrupt(fmt::format("{}: not nanotron's optimizer state_dict (its params named by 'names' beside "
                                 "'state' and 'param_groups')", fw));
    }
    if (sd.eight || sd.bnb || sd.torchao)
      return corrupt(fmt::format("{}: 8-bit or torchao state; {}'s AdamW is torch's", fw,
                                 np.megatron ? "Megatron" : "nanotron"));
    // (an expert rank's dense params and what is beside them are expert rank 0's; Megatron's
    // model dicts' other entries counted over the stages, in one line)
    for (size_t i = 0; i < sd.not_read.size(); ++i) {
      if (np.megatron && sd.model_others_line == i) {
        if (!f.dense_elsewhere && f.tp == 0) megatron_others += sd.model_others;
        if (megatron_others_key.empty()) megatron_others_key = sd.model_key;
        continue;
      }
      if (!f.dense_elsewhere && unread.insert(sd.not_read[i]).second) not_read_.push_back(sd.not_read[i]);
    }
    for (const std::string& n : sd.read_notes)
      if (std::find(value_notes_.begin(), value_notes_.end(), n) == value_notes_.end()) value_notes_.push_back(n);
    sds.push_back(std::move(sd));
  }
  if (megatron_others) not_read_.push_back(model_others_text(megatron_others_key, megatron_others));
  for (const std::string& n : np.not_read) not_read_.push_back(n);
  meta_.kind = "adamw";
  // Groups: each stage's own, its files' alike but for members.
  std::map<int64_t, size_t> base;  // stage -> its first group
  std::map<int64_t, size_t> first_file;  // stage -> its data-parallel rank 0's file
  for (size_t f = 0; f < np.files.size(); ++f) {
    const int64_t pp = np.files[f].pp;
    const std::string fw = np.files[f].path.string();
    const StateDict& sd = sds[f];
    // Megatron's stages each hold the optimizer's same groups: read as one set (the first stage's)
    if (!first_file.count(pp) && np.megatron && pp > 0 && first_file.count(0) &&
        sds[first_file[0]].groups.size() == sd.groups.size()) {
      bool same = true;
      const StateDict& s0 = sds[first_file[0]];
      for (size_t g = 0; g < sd.groups.size() && same; ++g) {
        const Hyperparameters &x = s0.groups[g].hyper, &y = sd.groups[g].hyper;
        same = same_number(x.beta1, y.beta1) && same_number(x.beta2, y.beta2) && same_number(x.eps, y.eps) &&
               same_number(x.weight_decay, y.weight_decay) && x.amsgrad == y.amsgrad && x.maximize == y.maximize &&
               s0.groups[g].extras.size() == sd.groups[g].extras.size();
        for (size_t k = 0; same && k < sd.groups[g].extras.size(); ++k)
          same = s0.groups[g].extras[k].key == sd.groups[g].extras[k].key;
      }
      if (same) {
        first_file[pp] = f;
        base[pp] = base[0];
      }
    }
    if (!first_file.count(pp)) {
      first_file[pp] = f;
      base[pp] = meta_.groups.size();
      for (size_t g = 0; g < sd.groups.size(); ++g) {
        ParamGroup group;
        group.hyper = sd.groups[g].hyper;
        OPTSTATE_ASSIGN_OR_RETURN(group.hyper.lr, value_of(f, sd.groups[g].lr, fmt::format("{} param group {} 'lr'", fw, g)));
        meta_.groups.push_back(std::move(group));
        adamw_flags_.push_back(sd.groups[g].flags);
        GroupExtras& kept = group_extras_.emplace_back();
        for (const GroupExtraSpec& x : sd.groups[g].extras) {
          if (!x.tensor) kept.emplace_back(x.key, x.value);
          else not_read_.push_back(fmt::format("{} param group {} '{}'", fw, g, x.key));
        }
      }
      continue;
    }
    const StateDict& s0 = sds[first_file[pp]];
    const std::string w0 = np.files[first_file[pp]].path.string();
    if (sd.groups.size() != s0.groups.size())
      return corrupt(fmt::format("{}: {} param groups; {} (the same pipeline stage) has {}", fw, sd.groups.size(), w0,
                                 s0.groups.size()));
    for (size_t g = 0; g < sd.groups.size(); ++g) {
      const Hyperparameters &x = s0.groups[g].hyper, &y = sd.groups[g].hyper;
      OPTSTATE_ASSIGN_OR_RETURN(const double lr, value_of(f, sd.groups[g].lr, fmt::format("{} param group {} 'lr'", fw, g)));
      if (!same_number(lr, meta_.groups[base[pp] + g].hyper.lr) || !same_number(x.beta1, y.beta1) ||
          !same_number(x.beta2, y.beta2) || !same_number(x.eps, y.eps) || !same_number(x.weight_decay, y.weight_decay) ||
          x.amsgrad != y.amsgrad || x.maximize != y.maximize)
        return corrupt(fmt::format("{}: param group {}'s hyperparameters differ from {}'s", fw, g, w0));
    }
  }
  // Each param: its specs in the files that hold it, in file order.
  std::vector<std::string> order;
  std::map<std::string, std::vector<std::pair<size_t, const ParamSpec*>>> held;
  std::map<std::string, std::set<int64_t>> tied_stages;  // a param's other stages
  std::set<size_t> tied_groups;                           // the groups of those copies
  size_t never_stepped = 0;
  for (size_t f = 0; f < sds.size(); ++f)
    for (const ParamSpec& spec : sds[f].params) {
      if (np.tied_copies.count({np.files[f].pp, spec.fqn})) {
        if (np.files[f].tp == 0)
          value_notes_.push_back(fmt::format("'{}' of pipeline stage {} is the first stage's "
                                             "embedding.word_embeddings.weight tied to it (equal weights and "
                                             "moments: Megatron sums their gradients): read once, as the embedding",
                                             spec.fqn, np.files[f].pp));
        continue;
      }
      // an expert rank's dense params: expert rank 0's (the driver checked them alike)
      if (np.files[f].dense_elsewhere && !megatron::is_expert_param(spec.fqn)) continue;
      if (spec.entries.empty()) {  // weights without state: never stepped
        never_stepped += np.files[f].dp == 0 && np.files[f].tp == 0;
        continue;
      }
      auto& specs = held[spec.fqn];
      if (specs.empty()) order.push_back(spec.fqn);
      // A param tied across stages (SmolLM's embeddings: the input embedding on the first, the
      // output head on the last) is stepped on each, its gradients summed over the tie, so its
      // copies are equal: the first stage's is read.
      if (!specs.empty() && np.files[specs[0].first].pp != np.files[f].pp) {
        tied_stages[spec.fqn].insert(np.files[f].pp);
        tied_groups.insert(base[np.files[f].pp] + static_cast<size_t>(spec.group));
        continue;
      }
      specs.emplace_back(f, &spec);
    }
  for (const auto& [name, stages] : tied_stages)
    value_notes_.push_back(fmt::format("'{}' is in the files of pipeline stages {} and {} (tied across them: "
                                       "nanotron steps each copy alike): stage {}'s read", name,
                                       np.files[held[name][0].first].pp, fmt::join(stages, ", "),
                                       np.files[held[name][0].first].pp));
  if (never_stepped)
    not_read_.push_back(fmt::format("{} param{} with fp32 weights and no state (never stepped)", never_stepped,
                                    never_stepped == 1 ? "" : "s"));
  for (const std::string& name : order) {
    const auto& specs = held[name];
    const auto& [f0, s0] = specs[0];
    const std::string pw = fmt::format("{} param '{}'", dir, name);
    const auto sh = np.sharded.find(name);
    const RankFileSet::Sharded* sharded = sh == np.sharded.end() ? nullptr : &sh->second;
    if (np.tp_size > 1 && !sharded && !np.replicated.count(name))
      return corrupt(fmt::format("{}: the model folder has no file of it, so whether tensor parallelism shards it "
                                 "(and where) is not known", pw));
    ParamState ps;
    ps.group = static_cast<int>(base[np.files[f0].pp] + static_cast<size_t>(s0->group));
    // A piece of a file's tensor: (file, spec, its first element in the tensor, in the whole, count).
    std::vector<std::tuple<size_t, const ParamSpec*, int64_t, int64_t, int64_t>> pieces;
    for (const auto& [f, spec] : specs) {
      const RankFileSet::File& file = np.files[f];
      const std::string fw = fmt::format("{} param '{}'", file.path.string(), name);
      if (!sharded && file.tp != 0) continue;  // a replica of tensor-parallel rank 0's
      // The rank's local tensor: its shape and where its elements go.
      std::vector<int64_t> local_shape;
      std::vector<RankFileSet::Run> runs;
      if (sharded) {
        const auto it = sharded->by_tp.find(file.tp);
        if (it == sharded->by_tp.end())
          return corrupt(fmt::format("{}: the model folder has no shard of it for tensor-parallel rank {}", fw, file.tp));
        local_shape = it->second.first;
        runs = it->second.second;
      } else if (np.zero) {
        const auto z = np.zero->find(name);
        const auto m = np.shapes.find(name);
        if (z != np.zero->end()) {
          local_shape = z->second.shape;
        } else if (m != np.shapes.end()) {
          local_shape = m->second;
        } else {
          return corrupt(fmt::format("{}: optimizer_config.json places no run of it (it holds rank 0's pipeline "
                                     "stage only), and the model folder has no file of it to shape it", fw));
        }
      } else {
        local_shape = spec->shape;
      }
      OPTSTATE_ASSIGN_OR_RETURN(const int64_t local_numel, checked_numel(local_shape));
      if (!sharded) runs = {{0, 0, local_numel}};
      // Its part of that tensor: all of it, or ZeRO-1's run of it for the file's data-parallel rank.
      int64_t start = 0, end = local_numel;
      if (np.zero) {
        const auto z = np.zero->find(name);
        const auto split = z != np.zero->end() && !sharded ? z->second.runs : np.zero_rule(local_numel);
        const auto r = split.find(file.dp);
        if (r == split.end())
          return corrupt(fmt::format("{}: held, but {} gives data-parallel rank {} no run of it", fw,
                                     z != np.zero->end() && !sharded ? "optimizer_config.json" : "nanotron's ZeRO-1 split",
                                     file.dp));
        std::tie(start, end) = r->second;
        if (start < 0 || end > local_numel || start > end)
          return corrupt(fmt::format("{}: run [{}, {}) outside its {} elements", fw, start, end, local_numel));
        if (spec->shape != std::vector<int64_t>{end - start})
          return corrupt(fmt::format("{}: shape {}, its run [{}, {}) of {} has {} elements", fw,
                                     format_shape(spec->shape), start, end,
                                     z != np.zero->end() && !sharded ? "optimizer_config.json" : "nanotron's ZeRO-1 split",
                                     end - start));
      } else if (spec->shape != local_shape) {
        return corrupt(fmt::format("{}: shape {}, its shard's is {}", fw, format_shape(spec->shape),
                                   format_shape(local_shape)));
      }
      for (const RankFileSet::Run& r : runs) {
        const int64_t lo = std::max(r.local, start), hi = std::min(r.local + r.count, end);
        if (lo < hi) pieces.emplace_back(f, spec, lo - start, r.global + (lo - r.local), hi - lo);
      }
      if (!sharded && ps.shape.empty()) ps.shape = local_shape;
    }
    if (sharded) ps.shape = sharded->shape;
    OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(ps.shape));
    std::sort(pieces.begin(), pieces.end(), [](const auto& a, const auto& b) { return std::get<3>(a) < std::get<3>(b); });
    int64_t at = 0;
    for (const auto& [f, spec, local, global, count] : pieces) {
      if (global != at)
        return corrupt(fmt::format("{}: its ranks' files {} element {} of it", pw, global < at ? "hold twice" : "leave out",
                                   std::min(global, at)));
      at += count;
    }
    if (at != numel)
      return corrupt(fmt::format("{}: its ranks' files hold {} of its {} elements", pw, at, numel));
    std::optional<int64_t> step;
    for (const auto& [f, spec] : specs) {
      const std::string fw = fmt::format("{} param '{}'", np.files[f].path.string(), name);
      if (base[np.files[f].pp] + static_cast<size_t>(spec->group) != static_cast<size_t>(ps.group))
        return corrupt(fmt::format("{}: in param group {}, {} has it in group {}", fw, spec->group,
                                   np.files[f0].path.string(), s0->group));
      OPTSTATE_ASSIGN_OR_RETURN(const double st, value_of(f, spec->step, fw + " 'step'"));
      if (!(st >= 0 && st < 9.2e18) || st != std::floor(st)) return corrupt(fmt::format("{}: step {} is not a count", fw, st));
      if (step && *step != static_cast<int64_t>(st))
        return corrupt(fmt::format("{}: step {}, another rank's file has {}", fw, st, *step));
      step = static_cast<int64_t>(st);
      if (spec->entries.size() != s0->entries.size() || spec->weight.has_value() != s0->weight.has_value())
        return corrupt(fmt::format("{}: other entries than {} has", fw, np.files[f0].path.string()));
    }
    ps.step = *step;
    std::vector<std::string> entries;
    for (const auto& [entry, es] : s0->entries) entries.push_back(entry);
    if (s0->weight) entries.push_back(kParam);  // the fp32 weights (gradient_accumulator)
    for (const std::string& entry : entries) {
      std::vector<Piece> stored;
      Entry e;
      for (const auto& [f, spec, local, global, count] : pieces) {
        const std::string ew = fmt::format("{} param '{}' '{}'", np.files[f].path.string(), name, entry);
        const dcp::TensorRef* t = nullptr;
        if (entry == kParam) {
          t = &*spec->weight;
        } else {
          const auto it = spec->entries.find(entry);
          if (it == spec->entries.end()) return corrupt(ew + ": missing");
          if (it->second.encoding != Encoding::kDense || it->second.dtensor) return corrupt(ew + ": not a plain tensor");
          t = &it->second.values;
        }
        if (stored.empty()) e.dtype = t->dtype;
        if (t->dtype != e.dtype || (e.dtype != DType::kF32 && e.dtype != DType::kBF16 && e.dtype != DType::kF16))
          return corrupt(fmt::format("{}: {}; optstate reads fp32, bf16 or fp16 of one dtype", ew, dtype_name(t->dtype)));
        if (t->shape != spec->shape)
          return corrupt(fmt::format("{}: shape {}, its state's is {}", ew, format_shape(t->shape), format_shape(spec->shape)));
        OPTSTATE_ASSIGN_OR_RETURN(const Stored whole, resolve(f, *t, *checked_numel(t->shape), ew));
        const auto elem = static_cast<uint64_t>(dtype_size(t->dtype));
        Piece pc{global, count, whole, std::nullopt};
        pc.stored.at += static_cast<uint64_t>(local) * elem;
        pc.stored.bytes = static_cast<uint64_t>(count) * elem;
        pc.stored.whole = whole.whole && pc.stored.bytes == whole.bytes;
        stored.push_back(pc);
      }
      stored_[{name, entry, Component::kValues}] = std::move(stored);
      if (entry == kParam) ps.param_dtype = e.dtype;
      ps.entries.emplace(entry, std::move(e));
    }
    OPTSTATE_RETURN_IF_ERROR(one_name(name, name, dir));
    meta_.groups[static_cast<size_t>(ps.group)].params.push_back(name);
    meta_.params.emplace(name, std::move(ps));
  }
  // A group that held only tied copies (nanotron's group per param) is left out, the others renumbered.
  std::vector<int> renumber(meta_.groups.size());
  size_t kept = 0;
  for (size_t g = 0; g < meta_.groups.size(); ++g) {
    renumber[g] = static_cast<int>(kept);
    if (tied_groups.count(g) && meta_.groups[g].params.empty()) continue;
    if (kept != g) {
      meta_.groups[kept] = std::move(meta_.groups[g]);
      adamw_flags_[kept] = std::move(adamw_flags_[g]);
      group_extras_[kept] = std::move(group_extras_[g]);
    }
    ++kept;
  }
  meta_.groups.resize(kept);
  adamw_flags_.resize(kept);
  group_extras_.resize(kept);
  for (auto& [name, ps] : meta_.params) ps.group = renumber[static_cast<size_t>(ps.group)];
  return finish({}, {}, 0);
}

auto TorchSaveReader::init_fsdp1(const std::vector<StateDict>& sds, const std::vector<fs::path>& optim_files,
                                 const std::vector<std::pair<ModelDict, size_t>>& models,
                                 const std::vector<fs::path>& model_files) -> Result<size_t> {
  const size_t world = sds.size();
  const std::string w0 = optim_files[0].string();
  if (models.size() != world)
    return corrupt(fmt::format("{}: {} optimizer files of FSDP1 (plain parts of flat parameters) and {} model files; "
                               "each rank's model file places its part", path_.string(), world, models.size()));
  bool model_dtensors = false;
  for (const ModelTensor& t : models[0].first.tensors) model_dtensors = model_dtensors || t.dtensor.has_value();
  // The model's params: its distinct DTensors in order (buffers are plain; a one-rank run's
  // file, all plain, gives every tensor: buffers there would not add up). FSDP1 saves a tied
  // weight (lm_head tied to the embedding) once per name, as two objects; FSDP flattened it once.
  // A later DTensor whose every rank's part is a whole storage record of the same size and CRC-32
  // as an earlier one of its shape is such a copy: left out where the params do not add up with it.
  std::vector<const ModelTensor*> all;
  std::set<pickle::Ref> seen;
  for (const ModelTensor& t : models[0].first.tensors)
    if ((t.dtensor || !model_dtensors) && seen.insert(t.ref).second) all.push_back(&t);
  std::vector<bool> tied(all.size(), false);
  std::set<std::pair<std::vector<int64_t>, std::vector<std::pair<uint32_t, uint64_t>>>> signatures;
  for (size_t j = 0; j < all.size(); ++j)
    if (auto sig = record_signature(models, all[j]->name))
      tied[j] = !signatures.emplace(global_shape(*all[j]), std::move(*sig)).second;
  const size_t copies = static_cast<size_t>(std::count(tied.begin(), tied.end(), true));
  const size_t members = sds[0].members;
  std::vector<const ModelTensor*> params;
  std::vector<std::string> names;
  std::vector<int64_t> numels;
  auto take = [&](bool without_copies) -> Status {
    params.clear();
    names.clear();
    numels.clear();
    for (size_t j = 0; j < all.size(); ++j) {
      if (without_copies && tied[j]) continue;
      OPTSTATE_ASSIGN_OR_RETURN(const int64_t n, checked_numel(global_shape(*all[j])));
      params.push_back(all[j]);
      names.push_back(all[j]->name);
      numels.push_back(n);
    }
    return Status::Ok();
  };
  OPTSTATE_RETURN_IF_ERROR(take(copies > 0 && members == all.size() - copies));
  const std::string where = fmt::format("{} ({} beside {})", path_.string(), rank_pattern(optim_files),
                                        rank_pattern(model_files));
  // Each rank's state by optimizer param id; dense 1-D fp32/bf16 parts only.
  std::vector<std::map<int64_t, const ParamSpec*>> by_id(world);
  for (size_t f = 0; f < world; ++f)
    for (const ParamSpec& ps : sds[f].params) {
      const std::string pw = fmt::format("{} param {}", optim_files[f].string(), ps.id);
      for (const auto& [name, es] : ps.entries) {
        if (es.encoding != Encoding::kDense)
          return corrupt(fmt::format("{} '{}': 8-bit state in FSDP1's files (flat parameters) is not read", pw, name));
        if (es.values.shape.size() != 1)
          return corrupt(fmt::format("{} '{}': shape {}; FSDP1's parts of flat parameters are 1-D", pw, name,
                                     format_shape(es.values.shape)));
      }
      by_id[f][ps.id] = &ps;
    }
  // Where each param lies: (optimizer param, offset in it), and each optimizer param's per-rank runs.
  const bool orig = members == params.size();
  std::vector<std::pair<int64_t, int64_t>> at(params.size());
  std::vector<int64_t> shard;  // flat: elements per rank of each unit
  if (orig) {
    for (size_t j = 0; j < params.size(); ++j) at[j] = {static_cast<int64_t>(j), 0};
  } else {
    if (members == 0 || members > params.size())
      return corrupt(fmt::format("{}: the optimizer steps {} params, the model has {}: not FSDP1's flat parameters "
                                 "of this model", where, members, params.size()));
    for (size_t u = 0; u < members; ++u) {
      for (size_t f = 0; f < world; ++f) {
        auto it = by_id[f].find(static_cast<int64_t>(u));
        if (it == by_id[f].end() || !it->second->entries.count(kExpAvg))
          return corrupt(fmt::format("{}: flat parameter {} has no exp_avg; every rank steps every FSDP unit",
                                     optim_files[f].string(), u));
        const int64_t n = it->second->entries.at(kExpAvg).values.shape[0];
        if (f == 0) shard.push_back(n);
        if (n != shard[u])
          return corrupt(fmt::format("{}: flat parameter {} holds {} elements, rank 0's {}; FSDP1 pads every "
                                     "rank's part to one size", optim_files[f].string(), u, n, shard[u]));
      }
    }
    auto units = match_flat_units(names, numels, shard, static_cast<int64_t>(world), where);
    if (!units.ok() && copies > 0) {  // with the tied copies left out
      OPTSTATE_RETURN_IF_ERROR(take(true));
      auto again = match_flat_units(names, numels, shard, static_cast<int64_t>(world), where);
      if (again.ok()) units = std::move(again);
      else OPTSTATE_RETURN_IF_ERROR(take(false));
    }
    if (!units.ok()) return units.status();
    at.resize(params.size());
    for (size_t j = 0; j < params.size(); ++j) at[j] = {units->unit_of[j], units->offset[j]};
    if (model_dtensors) {  // what a writer for another world size needs: each unit's params in order
      FsdpSet set{path_, optim_files, model_files, {}, std::vector<std::vector<FsdpSet::FlatParam>>(members)};
      std::vector<std::pair<std::pair<int64_t, int64_t>, size_t>> order;  // ((unit, offset), param)
      for (size_t j = 0; j < params.size(); ++j) order.push_back({at[j], j});
      std::sort(order.begin(), order.end());
      for (const auto& [place, j] : order)
        set.flat_units[static_cast<size_t>(place.first)].push_back({torch_param_fqn(names[j]), numels[j]});
      fsdp_ = std::move(set);
    }
  }
  size_t weights = 0, groupless = 0;
  for (size_t j = 0; j < params.size(); ++j) {
    const std::string fqn = torch_param_fqn(names[j]);
    OPTSTATE_RETURN_IF_ERROR(one_name(fqn, names[j], where));
    const int64_t id = at[j].first, offset = at[j].second, numel = numels[j];
    const std::string pw = fmt::format("{} param '{}'", where, fqn);
    ParamState ps;
    ps.shape = global_shape(*params[j]);
    // Every rank's run of this param, in rank order: (rank, begin in the rank's part, count).
    std::vector<std::tuple<size_t, int64_t, int64_t>> runs;
    std::set<std::string> entries;
    std::optional<int> group;
    std::optional<int64_t> step;
    int64_t covered = 0;
    for (size_t f = 0; f < world; ++f) {
      auto it = by_id[f].find(id);
      if (it == by_id[f].end()) continue;  // use_orig_params: no part of this param on this rank
      const ParamSpec& spec = *it->second;
      const std::string fw = fmt::format("{} param {} ('{}')", optim_files[f].string(), id, fqn);
      std::set<std::string> here;
      int64_t part = -1;
      for (const auto& [name, es] : spec.entries) {
        here.insert(name);
        if (part < 0) part = es.values.shape[0];
        if (es.values.shape[0] != part)
          return corrupt(fmt::format("{}: '{}' holds {} elements, its other moments {}", fw, name, es.values.shape[0], part));
      }
      if (part < 0) continue;
      if (orig && part > numel)  // a flat parameter's part (shard) was checked by match_flat_units
        return corrupt(fmt::format("{}: {} elements of a param of {}", fw, part, numel));
      if (entries.empty()) entries = here;
      if (here != entries)
        return corrupt(fmt::format("{}: moments {} where another rank's file has {}", fw, fmt::join(here, ", "),
                                   fmt::join(entries, ", ")));
      OPTSTATE_ASSIGN_OR_RETURN(const double st, value_of(f, spec.step, fw + " 'step'"));
      if (!(st >= 0 && st < 9.2e18) || st != std::floor(st)) return corrupt(fmt::format("{}: step {} is not a count", fw, st));
      if (step && *step != static_cast<int64_t>(st))
        return corrupt(fmt::format("{}: step {}, another rank's file has {}", fw, st, *step));
      step = static_cast<int64_t>(st);
      if (group && *group != spec.group)
        return corrupt(fmt::format("{}: in param group {}, another rank's file has it in {}", fw, spec.group, *group));
      group = spec.group;
      if (orig) {
        if (part > 0) runs.emplace_back(f, 0, part);
        covered += part;
      } else {
        const int64_t lo = std::max(offset, static_cast<int64_t>(f) * part);
        const int64_t hi = std::min(offset + numel, static_cast<int64_t>(f + 1) * part);
        if (lo < hi) runs.emplace_back(f, lo - static_cast<int64_t>(f) * part, hi - lo);
        covered += std::max<int64_t>(0, hi - lo);
      }
    }
    if (!group) {
      // No state on any rank (never stepped, or frozen): weights only, where the group is clear.
      if (meta_.groups.size() != 1) {
        ++groupless;
        continue;
      }
      group = 0;
    } else if (covered != numel) {
      return corrupt(fmt::format("{}: the ranks' parts hold {} of its {} elements", pw, covered, numel));
    }
    ps.group = *group;
    ps.step = step.value_or(0);
    for (const std::string& name : entries) {
      Entry e;
      std::vector<Piece> pieces;
      int64_t begin = 0;
      for (const auto& [f, local, count] : runs) {
        const EntrySpec& es = by_id[f].at(id)->entries.at(name);
        if (pieces.empty()) e.dtype = es.values.dtype;
        if (es.values.dtype != e.dtype || (e.dtype != DType::kF32 && e.dtype != DType::kBF16))
          return corrupt(fmt::format("{} '{}': {} in {}; FSDP1's moments are fp32 (or bf16) alike", pw, name,
                                     dtype_name(es.values.dtype), optim_files[f].string()));
        OPTSTATE_ASSIGN_OR_RETURN(Stored whole, resolve(f, es.values, es.values.shape[0],
                                                         fmt::format("{} '{}' in {}", pw, name, optim_files[f].string())));
        const auto elem = static_cast<uint64_t>(dtype_size(e.dtype));
        Piece pc{begin, count, whole, std::nullopt};
        pc.stored.at += static_cast<uint64_t>(local) * elem;
        pc.stored.bytes = static_cast<uint64_t>(count) * elem;
        pc.stored.whole = whole.whole && pc.stored.bytes == whole.bytes;
        pieces.push_back(pc);
        begin += count;
      }
      stored_[{fqn, name, Component::kValues}] = std::move(pieces);
      ps.entries.emplace(name, std::move(e));
    }
    OPTSTATE_ASSIGN_OR_RETURN(const bool found, model_weights(fqn, names[j], ps, models, model_files));
    weights += found;
    meta_.groups[static_cast<size_t>(ps.group)].params.push_back(fqn);
    meta_.params.emplace(fqn, std::move(ps));
  }
  if (groupless)
    not_read_.push_back(fmt::format("{} param{} without state on any rank (frozen, or never stepped), whose group "
                                    "the files do not say", groupless, groupless == 1 ? "" : "s"));
  return weights;
}

auto TorchSaveReader::record_signature(const std::vector<std::pair<ModelDict, size_t>>& models,
                                       const std::string& name) const
    -> std::optional<std::vector<std::pair<uint32_t, uint64_t>>> {
  std::vector<std::pair<uint32_t, uint64_t>> sig;
  for (const auto& [md, file] : models) {
    const ModelTensor* t = md.find(name);
    if (!t) return std::nullopt;
    const Archive& ar = files_[file];
    auto it = ar.entries.find(ar.prefix + "/data/" + t->tensor.storage_key);
    const auto numel = checked_numel(t->tensor.shape);
    if (it == ar.entries.end() || !numel.ok() || t->tensor.offset != 0 || t->tensor.storage_numel != *numel)
      return std::nullopt;
    const zip::Entry& e = ar.index.entries[it->second];
    if (e.size != static_cast<uint64_t>(*numel) * static_cast<uint64_t>(dtype_size(t->tensor.dtype))) return std::nullopt;
    sig.emplace_back(e.crc32, e.size);
  }
  return sig;
}

}  // namespace optstate::torchsave::detail
