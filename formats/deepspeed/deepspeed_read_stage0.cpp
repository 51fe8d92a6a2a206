// The torch.save reader's DeepSpeed-without-ZeRO part: FP16_Optimizer's flat groups (each param
// found in them by value; place_deepspeed_flat) and MoE's expert-parallel ranks' optimizer files
// (expp_rank_*, numbered params placed among the module's and the experts' tensors;
// init_moe_stage0). Layout: FORMAT.md.
#include "torchsave/torchsave_reader_impl.h"

namespace optstate::torchsave::detail {

auto TorchSaveReader::moe_candidates(const ModelDict& md, size_t file,
                                     const std::set<std::string, std::less<>>& buffers)
    -> Result<std::vector<MoeCand>> {
  std::vector<MoeCand> out;
  for (const size_t i : param_candidates(md)) {
    const ModelTensor& t = md.tensors[i];
    if (t.dtensor || buffers.count(t.name)) continue;
    if (t.tensor.dtype != DType::kF32 && t.tensor.dtype != DType::kBF16 && t.tensor.dtype != DType::kF16) continue;
    OPTSTATE_ASSIGN_OR_RETURN(const int64_t n, checked_numel(t.tensor.shape));
    out.push_back({t.name, t.tensor.shape, t.tensor, file, n});
  }
  return out;
}

auto TorchSaveReader::read_moe_rank(const fs::path& f, int64_t world) -> Result<MoeRank> {
  const std::string fw = f.string();
  OPTSTATE_ASSIGN_OR_RETURN(auto ap, open_archive(f));
  files_.push_back(std::move(ap.first));
  MoeRank r;
  r.file = files_.size() - 1;
  OPTSTATE_ASSIGN_OR_RETURN(r.sd, interpret_state_dict(ap.second, fw));
  if (r.sd.optimizer_path.rfind("['optimizer']", 0) != 0 || r.sd.per_param || r.sd.libtorch || r.sd.nanotron ||
      r.sd.megatron || r.sd.decoupled_decay)
    return corrupt(fw + ": not DeepSpeed's expert-parallel optimizer file ({'optimizer': its numbered state_dict})");
  for (const ParamSpec& spec : r.sd.params)
    if (spec.fqn != std::to_string(spec.id))
      return corrupt(fmt::format("{}: param '{}' is named in the file; DeepSpeed's optimizer numbers its params",
                                 fw, spec.fqn));
  if (r.sd.eight || r.sd.bnb || r.sd.torchao)
    return corrupt(fw + ": 8-bit or torchao state; DeepSpeed MoE without ZeRO is read with AdamW's fp32 state");
  for (size_t g = 0; g < r.sd.groups.size(); ++g) {
    bool moe = false;
    std::string name;
    for (const GroupExtraSpec& x : r.sd.groups[g].extras) {
      if (x.key == "moe") moe = x.value.kind == GroupValue::Kind::kBool && x.value.i;
      if (x.key == "name" && x.value.kind == GroupValue::Kind::kString) name = x.value.s;
    }
    const int64_t ep = moe ? moe_group_ep_size(name).value_or(0) : 0;
    if (moe && (ep < 1 || world % ep))
      return corrupt(fmt::format("{} param group {}: a mixture of experts' group ('moe') named '{}', not "
                                 "ep_size_<a divisor of the {} ranks>", fw, g, name, world));
    r.ep.push_back(ep);
  }
  if (!r.sd.deepspeed_flat) return r;
  OPTSTATE_ASSIGN_OR_RETURN(FlatGroups fg, flat_groups(r.sd, r.file, fw));
  r.numel = std::move(fg.numel);
  r.flat_of = std::move(fg.flat_of);
  return r;
}

auto TorchSaveReader::place_moe_groups(const MoeRank& r, int64_t ep, const std::vector<const MoeCand*>& cands,
                                       const std::string& fw) -> Result<MoePlacement> {
  MoePlacement out;
  std::vector<size_t> gk;  // the kind's groups
  for (size_t g = 0; g < r.sd.groups.size(); ++g)
    if (r.ep[g] == ep) gk.push_back(g);
  if (!r.sd.deepspeed_flat) {
    std::map<int64_t, const ParamSpec*> spec_of;
    for (const ParamSpec& s : r.sd.params) spec_of[s.id] = &s;
    std::vector<std::vector<std::optional<std::vector<int64_t>>>> groups;
    for (const size_t g : gk) {
      auto& shapes_of = groups.emplace_back();
      for (const int64_t id : r.sd.member_ids[g]) {
        const auto it = spec_of.find(id);
        shapes_of.push_back(it == spec_of.end() ? std::nullopt : std::optional(it->second->shape));
      }
    }
    std::vector<std::vector<int64_t>> tensors;
    for (const MoeCand* c : cands) tensors.push_back(c->shape);
    const ModelPlacement placed = place_params_in_model(groups, tensors);
    out.why = placed.why;
    if (out.why.empty())
      for (size_t k = 0; k < gk.size(); ++k)
        for (size_t i = 0; i < r.sd.member_ids[gk[k]].size(); ++i)
          out.placed.push_back({placed.tensor_of[k][i], gk[k], r.sd.member_ids[gk[k]][i], 0});
    return out;
  }
  std::vector<int64_t> group_numels, numels;
  std::vector<std::string> names;
  std::vector<int> classes;  // tensors of one dtype round alike
  for (const size_t g : gk) group_numels.push_back(r.numel[g]);
  for (const MoeCand* c : cands) {
    numels.push_back(c->numel);
    names.push_back(c->name);
    classes.push_back(static_cast<int>(c->tensor.dtype));
  }
  const std::string ow = fmt::format("{} {}['fp32_groups_flat']", fw, r.sd.deepspeed_flat_at);
  deepspeed::FlatValues values;
  values.flat = [&](size_t k, int64_t begin, std::span<const int64_t> at, size_t c) -> Result<std::vector<uint32_t>> {
    std::vector<int64_t> shifted(at.begin(), at.end());
    for (int64_t& i : shifted) i += begin;
    OPTSTATE_ASSIGN_OR_RETURN(auto bits, read_samples(files_[r.file], r.file, r.sd.deepspeed_flat_masters[gk[k]],
                                                      r.numel[gk[k]], shifted, fmt::format("{}[{}]", ow, gk[k])));
    round_samples(bits, cands[c]->tensor.dtype);
    return bits;
  };
  values.tensor = [&](size_t c, std::span<const int64_t> at) -> Result<std::vector<uint32_t>> {
    return read_samples(files_[cands[c]->file], cands[c]->file, cands[c]->tensor, cands[c]->numel, at,
                        fmt::format("{} ['{}']", files_[cands[c]->file].path.string(), cands[c]->name));
  };
  auto placed = deepspeed::place_in_flat_groups(group_numels, numels, names, values, ow, classes);
  if (!placed.ok()) {
    if (placed.status().code() != ErrorCode::kCorrupt) return placed.status();
    out.why = placed.status().message();
    return out;
  }
  for (size_t c = 0; c < cands.size(); ++c)
    if ((*placed)[c]) out.placed.push_back({c, gk[(*placed)[c]->group], 0, (*placed)[c]->begin});
  return out;
}

auto TorchSaveReader::init_moe_stage0(const MoeStage0Files& m) -> Status {
  deepspeed_ = true;
  set_ = true;
  meta_.kind = "adamw";
  const std::string mw = m.model.string();
  OPTSTATE_ASSIGN_OR_RETURN(auto model, open_archive(m.model));
  files_.push_back(std::move(model.first));
  const size_t model_file = files_.size() - 1;
  const pickle::Pickle& mp = model.second;
  OPTSTATE_ASSIGN_OR_RETURN(const ZeroShapes shapes, interpret_zero_model(mp, mw));
  if (!shapes.without_zero)
    return corrupt(mw + ": param_shapes set (a ZeRO run's model states) beside expp_rank_* files and no ZeRO "
                        "partitions (zero_pp_rank_*_optim_states.pt)");
  if (!shapes.autoep_layers.empty())
    return unsupported(mw + ": DeepSpeed AutoEP without ZeRO (ds_autoep_layers beside expp_rank_* files): not read; "
                            "AutoEP under ZeRO-1/2 is");
  const std::vector<int64_t>& num_experts = shapes.num_experts;
  if (num_experts.empty()) return corrupt(mw + ": no 'num_experts' list (the MoE layers' expert counts)");
  const pickle::Ref dpw = mp.dict_get(mp.root(), "dp_world_size");
  if (dpw == pickle::kNoRef || mp.at(dpw).kind != pickle::Kind::kInt || mp.at(dpw).i < 1 ||
      mp.at(dpw).i > (int64_t{1} << 24))
    return corrupt(mw + ": 'dp_world_size' is not a count of ranks");
  const int64_t world = mp.at(dpw).i;
  OPTSTATE_ASSIGN_OR_RETURN(const ModelDict dense, interpret_model_dict(mp, mp.dict_get(mp.root(), "module"),
                                                                        mw + " ['module']"));
  std::set<std::string, std::less<>> buffers;  // DeepSpeed's ['buffer_names']: the module's buffers
  if (const pickle::Ref b = mp.dict_get(mp.root(), "buffer_names"); b != pickle::kNoRef && mp.at(b).kind != pickle::Kind::kNone) {
    const auto names = dcp::as_string_list(mp, b);
    if (!names) return corrupt(mw + " ['buffer_names']: not a list of strings");
    buffers.insert(names->begin(), names->end());
  }
  OPTSTATE_ASSIGN_OR_RETURN(const std::vector<MoeCand> dense_cands, moe_candidates(dense, model_file, buffers));

  // Every layer's expert files, and no others; each expert's tensors that may be params (in its
  // state_dict's order: the expert module's).
  std::map<std::pair<size_t, int64_t>, std::vector<MoeCand>> expert;  // (layer, global number)
  size_t expert_files = 0, expert_others = 0;
  for (size_t l = 0; l < num_experts.size(); ++l) {
    const auto files = m.experts.find(static_cast<int64_t>(l));
    for (int64_t g = 0; g < num_experts[l]; ++g) {
      if (files == m.experts.end() || !files->second.count(g))
        return corrupt(fmt::format("{}: no layer_{}_expert_{}_mp_rank_00_model_states.pt (MoE layer {} of {} "
                                   "experts, num_experts in {})", m.dir.string(), l, g, l, num_experts[l], mw));
      const fs::path& f = files->second.at(g);
      OPTSTATE_ASSIGN_OR_RETURN(auto ap, open_archive(f));
      files_.push_back(std::move(ap.first));
      OPTSTATE_ASSIGN_OR_RETURN(const ModelDict md, interpret_model_dict(ap.second, f.string()));
      const std::string mark = fmt::format("deepspeed_moe.experts.deepspeed_experts.{}.", g);
      auto& tensors = expert[{l, g}];
      OPTSTATE_ASSIGN_OR_RETURN(tensors, moe_candidates(md, files_.size() - 1, {}));
      for (const MoeCand& t : tensors)
        if (t.name.find(mark) == std::string::npos)
          return corrupt(fmt::format("{}: '{}' is not a tensor of expert {} (<layer>.{}<param>)", f.string(), t.name, g,
                                     mark));
      expert_others += md.tensors.size() + md.others - tensors.size();
      ++expert_files;
    }
  }
  for (const auto& [l, es] : m.experts)
    if (l < 0 || static_cast<size_t>(l) >= num_experts.size() || es.rbegin()->first >= num_experts[static_cast<size_t>(l)])
      return corrupt(fmt::format("{}: layer_{}_expert_{}_mp_rank_00_model_states.pt, past the {} MoE layers' experts "
                                 "num_experts [{}] in {} lists", m.dir.string(), l, es.rbegin()->first,
                                 num_experts.size(), fmt::join(num_experts, ", "), mw));

  // Each expert-parallel rank's optimizer, its groups' expert-parallel sizes (0: dense).
  std::vector<MoeRank> ranks;
  for (const fs::path& f : m.optim) {
    OPTSTATE_ASSIGN_OR_RETURN(MoeRank r, read_moe_rank(f, world));
    ranks.push_back(std::move(r));
  }
  const int64_t ep_max = *std::max_element(ranks[0].ep.begin(), ranks[0].ep.end());
  if (ep_max == 0)
    return corrupt(m.optim[0].string() + ": no param group of experts ('moe', as DeepSpeed's "
                                         "split_params_into_different_moe_groups_for_optimizer makes them)");
  if (static_cast<int64_t>(ranks.size()) != ep_max)
    return corrupt(fmt::format("{}: {} expp_rank_* files, and the largest expert-parallel group has {} ranks "
                               "(ep_size_{})", m.dir.string(), ranks.size(), ep_max, ep_max));
  // The global rank that wrote expp_rank_e (its expert-data-parallel rank 0), and its rank in an
  // expert-parallel group of `ep` ranks: consecutive ranks a group, or W/ep apart
  // (use_data_before_expert_parallelism).
  auto ep_rank = [&](size_t e, int64_t ep) {
    const int64_t r = shapes.data_before_expert ? static_cast<int64_t>(e) * (world / ep_max) : static_cast<int64_t>(e);
    return shapes.data_before_expert ? r / (world / ep) : r % ep;
  };

  std::set<int64_t> sizes;
  for (const int64_t ep : ranks[0].ep)
    if (ep) sizes.insert(ep);
  // The experts rank e holds of the layers of size `ep` (layer_ep: each layer's size).
  auto expert_cands = [&](size_t e, int64_t ep, const std::vector<int64_t>& layer_ep, std::vector<const MoeCand*>& out) {
    out.clear();
    for (size_t l = 0; l < num_experts.size(); ++l) {
      if (layer_ep[l] != ep) continue;
      const int64_t n = num_experts[l] / ep, q = ep_rank(e, ep);
      for (int64_t i = 0; i < n; ++i)
        for (const MoeCand& t : expert.at({l, q * n + i})) out.push_back(&t);
    }
  };
  // Each layer's expert-parallel size: every assignment of the groups' sizes that divide its
  // expert count, tried on rank 0's file (at most 4096).
  std::vector<std::vector<int64_t>> choices(num_experts.size());
  size_t assignments = 1;
  for (size_t l = 0; l < num_experts.size(); ++l) {
    for (const int64_t ep : sizes)
      if (num_experts[l] % ep == 0) choices[l].push_back(ep);
    if (choices[l].empty())
      return corrupt(fmt::format("{}: MoE layer {} has {} experts (num_experts), which no expert-parallel size of "
                                 "the groups ({}) divides", mw, l, num_experts[l], fmt::join(sizes, ", ")));
    assignments *= choices[l].size();
    if (assignments > 4096)
      return unsupported(fmt::format("{}: more than 4096 ways to give the {} MoE layers the groups' expert-parallel "
                                     "sizes ({}): not tried", mw, num_experts.size(), fmt::join(sizes, ", ")));
  }
  std::vector<std::vector<int64_t>> fits;
  std::string why;
  std::vector<const MoeCand*> ts;
  for (size_t a = 0; a < assignments; ++a) {
    std::vector<int64_t> layer_ep(num_experts.size());
    for (size_t l = 0, k = a; l < num_experts.size(); k /= choices[l].size(), ++l) layer_ep[l] = choices[l][k % choices[l].size()];
    bool ok = true;
    for (const int64_t ep : sizes) {
      expert_cands(0, ep, layer_ep, ts);
      OPTSTATE_ASSIGN_OR_RETURN(const MoePlacement pl, place_moe_groups(ranks[0], ep, ts, m.optim[0].string()));
      if (!pl.why.empty()) {
        if (why.empty()) why = fmt::format("the groups of ep_size_{}: {}", ep, pl.why);
        ok = false;
        break;
      }
    }
    if (ok) fits.push_back(layer_ep);
  }
  if (fits.size() != 1)
    return corrupt(fmt::format("{}: {} of the MoE layers' expert-parallel sizes fits the param groups of experts "
                               "(placed in order and by shape among the experts' files){}", m.optim[0].string(),
                               fits.empty() ? "no assignment" : "more than one assignment",
                               fits.empty() ? " (" + why + ")" : fmt::format(" ([{}] and [{}])",
                                                                            fmt::join(fits[0], ", "),
                                                                            fmt::join(fits[1], ", "))));
  const std::vector<int64_t>& layer_ep = fits[0];

  // Groups: rank 0's; another rank's matched by name and settings (DeepSpeed orders the MoE
  // groups by a set of their names, so ranks may list them in other orders), the k-th alike of
  // each to the k-th.
  auto settings = [](const GroupSpec& g, int64_t ep) {
    std::vector<std::string> keys;
    for (const GroupExtraSpec& x : g.extras) keys.push_back(x.key);
    return fmt::format("{} {} {} {} {} {} {} [{}]", ep, g.hyper.beta1, g.hyper.beta2, g.hyper.eps,
                       g.hyper.weight_decay, g.hyper.amsgrad, g.hyper.maximize, fmt::join(keys, ","));
  };
  std::vector<std::vector<size_t>> group_of(ranks.size());  // rank's group -> rank 0's
  for (size_t e = 0; e < ranks.size(); ++e) {
    const MoeRank& r = ranks[e];
    const std::string fw = m.optim[e].string();
    if (r.sd.groups.size() != ranks[0].sd.groups.size())
      return corrupt(fmt::format("{}: {} param groups; {} has {}", fw, r.sd.groups.size(), m.optim[0].string(),
                                 ranks[0].sd.groups.size()));
    std::map<std::string, std::vector<size_t>> free;
    for (size_t g = ranks[0].sd.groups.size(); g-- > 0;)
      free[settings(ranks[0].sd.groups[g], ranks[0].ep[g])].push_back(g);
    for (size_t g = 0; g < r.sd.groups.size(); ++g) {
      auto& left = free[settings(r.sd.groups[g], r.ep[g])];
      if (left.empty())
        return corrupt(fmt::format("{} param group {}: no group of {} has its settings", fw, g, m.optim[0].string()));
      group_of[e].push_back(left.back());
      left.pop_back();
    }
  }
  std::vector<double> decays;
  for (size_t g = 0; g < ranks[0].sd.groups.size(); ++g) {
    const GroupSpec& gs = ranks[0].sd.groups[g];
    ParamGroup group;
    group.hyper = gs.hyper;
    OPTSTATE_ASSIGN_OR_RETURN(group.hyper.lr, value_of(ranks[0].file, gs.lr, fmt::format("{} param group {} 'lr'",
                                                                                       m.optim[0].string(), g)));
    decays.push_back(group.hyper.weight_decay);
    meta_.groups.push_back(std::move(group));
    adamw_flags_.push_back(gs.flags);
    GroupExtras& kept = group_extras_.emplace_back();
    for (const GroupExtraSpec& x : gs.extras) {
      if (!x.tensor) kept.emplace_back(x.key, x.value);
      else not_read_.push_back(fmt::format("{} param group {} '{}'", m.optim[0].string(), g, x.key));
    }
  }
  OPTSTATE_RETURN_IF_ERROR(check_zero_decay(shapes, decays, mw));
  for (size_t e = 1; e < ranks.size(); ++e)
    for (size_t g = 0; g < ranks[e].sd.groups.size(); ++g) {
      const size_t g0 = group_of[e][g];
      OPTSTATE_ASSIGN_OR_RETURN(const double lr, value_of(ranks[e].file, ranks[e].sd.groups[g].lr,
                                                          fmt::format("{} param group {} 'lr'", m.optim[e].string(), g)));
      if (!same_number(lr, meta_.groups[g0].hyper.lr))
        return corrupt(fmt::format("{} param group {}: lr {}, its group in {} has {}", m.optim[e].string(), g, lr,
                                   m.optim[0].string(), meta_.groups[g0].hyper.lr));
    }

  // Each rank's params: rank 0's dense ones and every rank's experts, named and read.
  std::vector<const MoeCand*> dense_ptrs;
  for (const MoeCand& c : dense_cands) dense_ptrs.push_back(&c);
  const bool masters = ranks[0].sd.deepspeed_fp16, flat = ranks[0].sd.deepspeed_flat;
  size_t stateless = 0, dense_weights = 0, expert_copies = 0;
  static const std::optional<DTensorSpec> plain;
  for (size_t e = 0; e < ranks.size(); ++e) {
    const MoeRank& r = ranks[e];
    const std::string fw = m.optim[e].string();
    if (r.sd.deepspeed_fp16 != masters || r.sd.deepspeed_flat != flat)
      return corrupt(fmt::format("{}: another optimizer wrapper than {}'s ({})", fw, m.optim[0].string(),
                                 flat ? "FP16_Optimizer's flat groups" : masters ? "FP16_UnfusedOptimizer's" : "none"));
    std::vector<std::pair<MoeSpot, const MoeCand*>> all;  // (placement, its tensor), dense ones first
    if (e == 0) {
      OPTSTATE_ASSIGN_OR_RETURN(const MoePlacement pl, place_moe_groups(r, 0, dense_ptrs, fw));
      if (!pl.why.empty())
        return corrupt(fmt::format("{}: its dense param groups placed among {} ['module']'s params: {}", fw, mw, pl.why));
      for (const MoeSpot& x : pl.placed) all.emplace_back(x, dense_ptrs[x.cand]);
    }
    for (const int64_t ep : sizes) {
      expert_cands(e, ep, layer_ep, ts);
      OPTSTATE_ASSIGN_OR_RETURN(const MoePlacement pl, place_moe_groups(r, ep, ts, fw));
      if (!pl.why.empty())
        return corrupt(fmt::format("{}: its groups of ep_size_{} placed among its experts (MoE layers' sizes [{}]): {}",
                                   fw, ep, fmt::join(layer_ep, ", "), pl.why));
      for (const MoeSpot& x : pl.placed) all.emplace_back(x, ts[x.cand]);
    }
    // in each group's order (torch numbers a group's params in its order; a flat master packs them)
    std::stable_sort(all.begin(), all.end(), [](const auto& a, const auto& b) {
      return std::tie(a.first.group, a.first.id, a.first.begin) < std::tie(b.first.group, b.first.id, b.first.begin);
    });
    std::map<int64_t, const ParamSpec*> spec_of;
    for (const ParamSpec& s : r.sd.params) spec_of[s.id] = &s;
    for (const auto& item : all) {
      const MoeSpot& x = item.first;  // not structured bindings: clang 14 cannot capture them (view)
      const MoeCand* cand = item.second;
      const std::string& fqn = cand->name;
      const bool is_expert = r.ep[x.group] != 0;
      // an expert of a layer of a smaller expert-parallel size than the largest: rank e's copy
      // of what an earlier rank of its expert-data-parallel group holds (stepped alike)
      if (is_expert && meta_.params.count(fqn)) {
        ++expert_copies;
        continue;
      }
      // the state: the param's own (numbered), or its run of its group's flat param
      const ParamSpec* spec = nullptr;
      if (!flat) {
        const auto sp = spec_of.find(x.id);
        if (sp == spec_of.end()) {
          ++stateless;
          continue;
        }
        spec = sp->second;
      }
      OPTSTATE_RETURN_IF_ERROR(one_name(fqn, fqn, fw));
      const std::string pw = flat ? fmt::format("{} param group {} elements {}.. ('{}')", fw, x.group, x.begin, fqn)
                                  : fmt::format("{} param {} ('{}')", fw, x.id, fqn);
      auto view = [&](dcp::TensorRef t) {  // the param's run of a flat tensor
        if (!flat) return t;
        t.offset += x.begin;
        t.shape = cand->shape;
        t.stride.clear();
        return t;
      };
      const ParamSpec* state = !flat ? spec : r.flat_of[x.group] ? &r.sd.params[*r.flat_of[x.group]] : nullptr;
      ParamState ps;
      ps.shape = cand->shape;
      ps.group = static_cast<int>(group_of[e][x.group]);
      if (state) {
        if (!flat && state->shape != cand->shape) return internal_error(pw + ": placed at another shape");
        OPTSTATE_ASSIGN_OR_RETURN(const double step, value_of(r.file, state->step, pw + " 'step'"));
        if (!(step >= 0 && step < 9.2e18) || step != std::floor(step))
          return corrupt(fmt::format("{}: step {} is not a count", pw, step));
        ps.step = static_cast<int64_t>(step);
        for (const auto& [name, es] : state->entries) {
          if (es.encoding != Encoding::kDense || es.dtensor)
            return corrupt(fmt::format("{} '{}': not a plain tensor", pw, name));
          OPTSTATE_ASSIGN_OR_RETURN(Placed v, place(ps.shape, {Part(r.file, view(es.values), &es.dtensor)},
                                                    fmt::format("{} '{}'", pw, name), /*dense=*/true));
          stored_[{fqn, name, Component::kValues}] = std::move(v.pieces);
          Entry en;
          en.dtype = es.values.dtype;
          ps.entries.emplace(name, std::move(en));
        }
      }
      // Weights: the wrapper's fp32 masters; else the module's (dense) or the expert file's.
      if (flat) {
        OPTSTATE_RETURN_IF_ERROR(add_weights(fqn, ps, {Part(r.file, view(r.sd.deepspeed_flat_masters[x.group]), &plain)},
                                             fmt::format("{} {}['fp32_groups_flat'][{}] ('{}')", fw,
                                                         r.sd.deepspeed_flat_at, x.group, fqn)));
      } else if (masters) {
        if (!spec->weight) return corrupt(pw + ": no fp32 master in ['optimizer']['fp32_groups']");
        OPTSTATE_RETURN_IF_ERROR(add_weights(fqn, ps, {Part(r.file, *spec->weight, &plain)},
                                             fmt::format("{} ['optimizer']['fp32_groups'] ('{}')", fw, fqn)));
      } else {
        OPTSTATE_RETURN_IF_ERROR(add_weights(fqn, ps, {Part(cand->file, cand->tensor, &plain)},
                                             fmt::format("{} ['{}']", files_[cand->file].path.string(), fqn)));
        dense_weights += !is_expert;
      }
      meta_.groups[ps.group].params.push_back(fqn);
      meta_.params.emplace(fqn, std::move(ps));
    }
  }

  // What is not read, and how the state was read.
  for (const std::string& n : shapes.not_read) {
    if (n.rfind("['module']", 0) == 0) continue;  // below
    not_read_.push_back(mw + " " + n);
  }
  const size_t module_entries = dense.tensors.size() + dense.others;
  if (masters || flat) {
    not_read_.push_back(fmt::format("{} ['module'] ({} entries: the dense params' weights and buffers in their "
                                    "training dtype; the fp32 masters are read)", mw, module_entries));
  } else if (module_entries > dense_weights) {
    not_read_.push_back(fmt::format("{} ['module'] ({} entr{} besides the optimized params' weights)", mw,
                                    module_entries - dense_weights, module_entries - dense_weights == 1 ? "y" : "ies"));
  }
  for (const std::string& n : ranks[0].sd.not_read) not_read_.push_back(m.optim[0].string() + " " + n);
  if (stateless)
    not_read_.push_back(fmt::format("{} param{} without state (never stepped: no shape in the files)", stateless,
                                    stateless == 1 ? "" : "s"));
  if ((masters || flat) && expert_files)
    uncarried_notes_.push_back(fmt::format("layer_*_expert_*_model_states.pt ({} file{}: the experts' weights in "
                                           "their training dtype; the fp32 masters are read)", expert_files,
                                           expert_files == 1 ? "" : "s"));
  else if (expert_others)
    uncarried_notes_.push_back(fmt::format("layer_*_expert_*_model_states.pt ({} entr{} besides the experts' params)",
                                           expert_others, expert_others == 1 ? "y" : "ies"));
  if (ranks.size() > 1)
    uncarried_notes_.push_back(fmt::format("expp_rank_1.._{}: their dense params (copies of expp_rank_0's: every "
                                           "rank steps them alike){}", ranks.size() - 1,
                                           expert_copies ? fmt::format(", and {} params of experts an earlier file "
                                                                       "holds too (layers of a smaller expert-"
                                                                       "parallel size)", expert_copies) : ""));
  value_notes_.push_back(fmt::format(
      "DeepSpeed MoE without ZeRO: each expert-parallel rank's numbered params named by order and shape after "
      "['module'] (dense) and its experts' layer_L_expert_G files (MoE layers' expert-parallel sizes [{}]); "
      "experts under their global numbers (rank e's local expert i is e*n+i), the dense params from expp_rank_0{}",
      fmt::join(layer_ep, ", "),
      flat ? "; FP16_Optimizer's flat groups: each param placed in its group's fp32 master where the master rounds "
             "to its weights (the module's, the experts' files'), its moments and master the flat tensors' run there"
      : masters ? "; the wrapper's fp32 masters (['optimizer']['fp32_groups']) read as the weights" : ""));
  return finish({}, {}, 0);
}

auto TorchSaveReader::flat_groups(const StateDict& sd, size_t fi, const std::string& where) -> Result<FlatGroups> {
  const std::string ow = fmt::format("{} {}", where, sd.deepspeed_flat_at);
  const size_t groups = sd.groups.size();
  if (sd.deepspeed_flat_masters.size() != groups || sd.member_ids.size() != groups)
    return corrupt(fmt::format("{}['fp32_groups_flat']: {} flat masters, the optimizer has {} param groups", ow,
                               sd.deepspeed_flat_masters.size(), groups));
  FlatGroups out;
  out.numel.resize(groups);
  out.flat_of.assign(groups, std::nullopt);
  for (size_t g = 0; g < groups; ++g) {
    const std::string mw = fmt::format("{}['fp32_groups_flat'][{}]", ow, g);
    if (sd.member_ids[g].size() != 1)
      return corrupt(fmt::format("{}['optimizer_state_dict'] param group {}: {} params; FP16_Optimizer gives its "
                                 "optimizer one flat param a group", ow, g, sd.member_ids[g].size()));
    OPTSTATE_ASSIGN_OR_RETURN(out.numel[g], checked_numel(sd.deepspeed_flat_masters[g].shape));
    OPTSTATE_RETURN_IF_ERROR(resolve(fi, sd.deepspeed_flat_masters[g], out.numel[g], mw).status());
  }
  for (size_t k = 0; k < sd.params.size(); ++k) {
    const ParamSpec& ps = sd.params[k];
    const size_t g = static_cast<size_t>(ps.group);
    const std::string pw = fmt::format("{}['optimizer_state_dict'] param group {}'s flat param", ow, g);
    if (g >= groups || out.flat_of[g]) return internal_error(pw + ": listed twice");
    if (ps.shape != std::vector<int64_t>{out.numel[g]})
      return corrupt(fmt::format("{}: state of shape {}, its flat master's is [{}]", pw, format_shape(ps.shape),
                                 out.numel[g]));
    for (const auto& [name, es] : ps.entries)
      if (es.encoding != Encoding::kDense || es.dtensor)
        return corrupt(fmt::format("{}: '{}' is not a plain tensor (FP16_Optimizer's fused optimizers keep dense "
                                   "fp32 moments)", pw, name));
    out.flat_of[g] = k;
  }
  return out;
}

auto TorchSaveReader::place_deepspeed_flat(const pickle::Pickle& p, size_t fi, StateDict& sd,
                                           const std::string& where) -> Status {
  const std::string ow = fmt::format("{} {}", where, sd.deepspeed_flat_at);
  const size_t groups = sd.groups.size();
  OPTSTATE_ASSIGN_OR_RETURN(const FlatGroups fg, flat_groups(sd, fi, where));
  const std::vector<int64_t>& group_numels = fg.numel;
  std::vector<const ParamSpec*> flat_of(groups, nullptr);
  for (size_t g = 0; g < groups; ++g)
    if (fg.flat_of[g]) flat_of[g] = &sd.params[*fg.flat_of[g]];
  if (sd.model_ref == pickle::kNoRef)
    return corrupt(ow + ": DeepSpeed's FP16_Optimizer without the model beside it (['module']), whose weights place "
                        "the params in its flat masters");
  const std::string model_at = fmt::format("{} {}", where, sd.model_key);
  OPTSTATE_ASSIGN_OR_RETURN(const ModelDict md, interpret_model_dict(p, sd.model_ref, model_at));
  std::set<std::string, std::less<>> buffers;  // DeepSpeed's ['buffer_names']: the module's buffers
  if (const pickle::Ref b = p.dict_get(p.root(), "buffer_names"); b != pickle::kNoRef && p.at(b).kind != pickle::Kind::kNone) {
    const auto names = dcp::as_string_list(p, b);
    if (!names) return corrupt(where + " ['buffer_names']: not a list of strings");
    buffers.insert(names->begin(), names->end());
  }
  // The candidates: the module's fp32/bf16/fp16 tensors that may be params and are no buffer.
  std::vector<size_t> cand;
  std::vector<int64_t> numels;
  std::vector<std::string> names;
  for (const size_t t : param_candidates(md)) {
    const ModelTensor& mt = md.tensors[t];
    if (mt.dtensor || buffers.count(mt.name)) continue;
    if (mt.tensor.dtype != DType::kF16 && mt.tensor.dtype != DType::kBF16 && mt.tensor.dtype != DType::kF32) continue;
    OPTSTATE_ASSIGN_OR_RETURN(const int64_t n, checked_numel(mt.tensor.shape));
    cand.push_back(t);
    numels.push_back(n);
    names.push_back(mt.name);
  }
  deepspeed::FlatValues values;
  values.flat = [&](size_t g, int64_t begin, std::span<const int64_t> at, size_t c) -> Result<std::vector<uint32_t>> {
    std::vector<int64_t> shifted(at.begin(), at.end());
    for (int64_t& i : shifted) i += begin;
    OPTSTATE_ASSIGN_OR_RETURN(auto bits, read_samples(files_[fi], fi, sd.deepspeed_flat_masters[g], group_numels[g],
                                                      shifted, fmt::format("{}['fp32_groups_flat'][{}]", ow, g)));
    round_samples(bits, md.tensors[cand[c]].tensor.dtype);
    return bits;
  };
  values.tensor = [&](size_t c, std::span<const int64_t> at) -> Result<std::vector<uint32_t>> {
    return read_samples(files_[fi], fi, md.tensors[cand[c]].tensor, numels[c], at,
                        fmt::format("{}['{}']", model_at, names[c]));
  };
  std::vector<int> classes;  // tensors of one dtype round alike
  for (const size_t t : cand) classes.push_back(static_cast<int>(md.tensors[t].tensor.dtype));
  OPTSTATE_ASSIGN_OR_RETURN(const auto placed, deepspeed::place_in_flat_groups(group_numels, numels, names, values,
                                                                               ow + "['fp32_groups_flat']", classes));
  std::vector<ParamSpec> params;
  std::vector<std::vector<int64_t>> member_ids(groups);
  std::set<std::string> weights_read;
  size_t frozen = 0;
  for (size_t g = 0; g < groups; ++g) sd.groups[g].params.clear();
  for (size_t g = 0; g < groups; ++g)
    for (size_t c = 0; c < cand.size(); ++c) {
      if (!placed[c] || placed[c]->group != g) continue;
      const ModelTensor& mt = md.tensors[cand[c]];
      auto view = [&](dcp::TensorRef t) {
        t.offset += placed[c]->begin;
        t.shape = mt.tensor.shape;
        t.stride.clear();
        return t;
      };
      ParamSpec spec;
      spec.fqn = mt.name;
      spec.id = static_cast<int64_t>(params.size());
      spec.group = static_cast<int>(g);
      spec.shape = mt.tensor.shape;
      if (const ParamSpec* flat = flat_of[g]) {
        spec.step = flat->step;
        for (const auto& [name, es] : flat->entries) {
          EntrySpec part = es;
          part.values = view(es.values);
          spec.entries.emplace(name, std::move(part));
        }
      } else {
        spec.step.number = 0;  // the group never stepped: no moments, the master as its weights
      }
      spec.weight = view(sd.deepspeed_flat_masters[g]);
      member_ids[g].push_back(spec.id);
      sd.groups[g].params.push_back(spec.fqn);
      weights_read.insert(mt.name);
      params.push_back(std::move(spec));
    }
  for (size_t c = 0; c < cand.size(); ++c) frozen += placed[c] ? 0 : 1;
  sd.stateless = 0;
  for (size_t g = 0; g < groups; ++g) sd.stateless += flat_of[g] ? 0 : member_ids[g].size();
  sd.params = std::move(params);
  sd.member_ids = std::move(member_ids);
  sd.members = sd.params.size();
  sd.model_weight_keys = weights_read;
  sd.model_others = md.tensors.size() + md.others - weights_read.size();
  if (sd.model_others) {
    sd.model_others_line = sd.not_read.size();
    sd.not_read.push_back(model_others_text(sd.model_key, sd.model_others));
  }
  if (frozen)
    sd.not_read.push_back(fmt::format("{} model tensor{} in no param group's flat master (frozen params, or params "
                                      "not given to the optimizer)", frozen, frozen == 1 ? "" : "s"));
  sd.read_notes.push_back(fmt::format(
      "DeepSpeed's FP16_Optimizer keeps each param group flat ({}['fp32_groups_flat'], no param's place): each "
      "param found in module order where its fp32 master rounds to the module's weights ({}), read as the weights",
      sd.deepspeed_flat_at, sd.model_key));
  return Status::Ok();
}

}  // namespace optstate::torchsave::detail
