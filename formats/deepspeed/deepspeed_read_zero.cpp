// The torch.save reader's DeepSpeed ZeRO part (stages 1-3; TorchSaveReader::init_zero): each
// data-parallel rank's runs of the flat groups put back into params by the model states'
// param_shapes, a pipeline's stages joined (tied modules' later copies compared), AutoTP's
// tensor-parallel shards placed by their affine maps, MoE's and AutoEP's experts. Layout: FORMAT.md.
#include "torchsave/torchsave_reader_impl.h"

namespace optstate::torchsave::detail {

auto TorchSaveReader::init_zero(const ZeroFiles& z) -> Status {
  deepspeed_ = true;
  set_ = true;
  meta_.kind = "adamw";
  std::vector<ZeroSlice> slices;
  for (size_t st = 0; st < z.stages.size(); ++st) {
    OPTSTATE_ASSIGN_OR_RETURN(ZeroSlice slice, read_zero_slice(z, st));
    slices.push_back(std::move(slice));
  }
  const size_t autoep_layers = slices.front().shapes.autoep_layers.size();
  if (z.tensor_parallel) {
    tensor_parallel_ = true;
    OPTSTATE_RETURN_IF_ERROR(join_tensor_parallel(z, slices));
  } else {
    std::vector<int64_t> group_steps;        // each joined group's step, as its first stage had it
    std::map<std::string, size_t> stage_of;  // each param: the stage it is read from
    for (size_t st = 0; st < slices.size(); ++st)
      OPTSTATE_RETURN_IF_ERROR(join_pipeline_stage(z, st, std::move(slices[st]), group_steps, stage_of));
    std::map<std::string, std::set<size_t>> tied;
    for (const ZeroCopy& c : zero_copies_) tied[c.fqn].insert(c.stage);
    for (const auto& [name, stages] : tied)
      value_notes_.push_back(fmt::format("'{}' is held by pipeline stages {} and {} (a tied module: DeepSpeed sums "
                                         "its gradients over the tie, so its copies are equal): stage {}'s read; "
                                         "validate compares the copies", name, stage_of.at(name),
                                         fmt::join(stages, ", "), stage_of.at(name)));
  }
  if (!z.expert_files.empty()) {
    size_t files = 0;
    for (const auto& [l, es] : z.expert_files) files += es.size();
    const size_t native = z.expert_files.size() - std::min(z.expert_files.size(), autoep_layers);
    if (native)
      value_notes_.push_back(fmt::format("DeepSpeed MoE: {} MoE layer{} experts read under their global numbers "
                                         "(expert-parallel rank e's local expert i is expert e*n+i, n experts a "
                                         "rank), each from its expert-data-parallel ranks' partitions", native,
                                         native == 1 ? "'s" : "s'"));
    if (autoep_layers)
      value_notes_.push_back(fmt::format("DeepSpeed AutoEP: {} MoE layer{} fused experts (w1, w2, w3) read whole, "
                                         "[experts, ...]: expert-parallel rank e's shard as experts e*n.. (its "
                                         "affine map), each from its expert-data-parallel ranks' partitions",
                                         autoep_layers, autoep_layers == 1 ? "'s" : "s'"));
    uncarried_notes_.push_back(fmt::format("layer_*_expert_*_model_states.pt ({} file{}: the experts' weights in "
                                           "their training dtype; the optimizer's fp32 weights are read)", files,
                                           files == 1 ? "" : "s"));
  }
  if (z.expert_optim_files)
    uncarried_notes_.push_back(fmt::format("expp_rank_*_optim_states.pt ({} file{}: under ZeRO they hold no state)",
                                           z.expert_optim_files, z.expert_optim_files == 1 ? "" : "s"));
  if (z.layer_files)  // not in a universal checkpoint either (DeepSpeed loads its weights from zero/)
    uncarried_notes_.push_back(fmt::format("layer_*-model_states.pt ({} file{}: the pipeline's module weights per "
                                           "layer, in their training dtype; the optimizer's fp32 weights are read)",
                                           z.layer_files, z.layer_files == 1 ? "" : "s"));
  return finish({}, {}, 0);
}

auto TorchSaveReader::autoep_whole_shape(const std::string& name, const std::vector<int64_t>& shard, int64_t ep,
                                         const ZeroShapes::AutoEpLayer& layer, const AffineMap& m,
                                         const std::string& mw) -> Result<std::vector<int64_t>> {
  auto contiguous = [](const std::vector<int64_t>& shape) {
    std::vector<int64_t> strides(shape.size(), 1);
    for (size_t d = shape.size(); d-- > 1;) strides[d - 1] = strides[d] * shape[d];
    return strides;
  };
  const std::string pw = fmt::format("{}: AutoEP's '{}'", mw, name);
  if (layer.ep_size != ep)
    return corrupt(fmt::format("{}: in a group of expert-parallel size {}, its layer's ep_size {}", pw, ep, layer.ep_size));
  const std::vector<int64_t>& whole = m.logical_shape;
  if (shard.empty() || whole.size() != shard.size() || shard[0] != layer.num_local_experts ||
      whole[0] != layer.num_experts || !std::equal(shard.begin() + 1, shard.end(), whole.begin() + 1))
    return corrupt(fmt::format("{}: shape [{}] of {} local experts, whole [{}] of {}", pw, fmt::join(shard, ", "),
                               layer.num_local_experts, fmt::join(whole, ", "), layer.num_experts));
  const int64_t numel = *checked_numel(shard);
  if (m.ranks.size() != static_cast<size_t>(ep) || m.ranks.rbegin()->first != ep - 1)
    return corrupt(fmt::format("{}: a map of {} ranks for {} expert-parallel ranks", pw, m.ranks.size(), ep));
  for (const auto& [e, ar] : m.ranks) {
    const bool one_block = ar.shard_shape == shard && ar.pieces.size() == 1 && ar.pieces[0].shape == shard &&
                           ar.pieces[0].locations == std::vector<int64_t>{e} && ar.pieces[0].scale == 1.0 &&
                           ar.pieces[0].dest_offset == 0 && ar.pieces[0].dest_strides == contiguous(shard) &&
                           ar.pieces[0].source_strides == contiguous(whole) && ar.pieces[0].source_offset == e * numel;
    if (!one_block)
      return corrupt(fmt::format("{}: expert-parallel rank {}'s map is not its shard whole as experts {} to {} "
                                 "(AutoEP folded with AutoTP?): not read", pw, e, e * layer.num_local_experts,
                                 (e + 1) * layer.num_local_experts - 1));
  }
  return whole;
}

auto TorchSaveReader::zero_experts(const ZeroFiles& z, const ZeroRank& r0, const ZeroShapes& shapes,
                                   const std::string& mw) -> Result<ZeroExperts> {
  ZeroExperts out;
  const bool moe = std::any_of(r0.groups.begin(), r0.groups.end(), [](const ZeroGroup& zg) { return zg.ep_size; });
  if (!moe) {
    if (!z.expert_files.empty() || !shapes.num_experts.empty())
      return corrupt(fmt::format("{}: MoE layers (num_experts, layer_*_expert_* files), but no param group of experts "
                                 "('moe', as DeepSpeed's split_params_into_different_moe_groups_for_optimizer makes "
                                 "them), which DeepSpeed's ZeRO requires", mw));
    return out;
  }
  if (shapes.num_experts.empty())
    return corrupt(mw + ": param groups of experts ('moe'), but no 'num_experts' list of the MoE layers");
  constexpr std::string_view marker = "deepspeed_moe.experts.deepspeed_experts.";
  std::map<std::string, size_t> layer_of;  // prefix -> layers
  std::map<std::string, std::set<int64_t>> ids;
  for (size_t g = 0; g < r0.groups.size(); ++g) {
    if (!r0.groups[g].ep_size) continue;
    for (const auto& param : shapes.groups[g]) {
      const std::string& name = param.first;  // not a structured binding: the lambda below takes it
      const std::vector<int64_t>& shape = param.second;
      if (const auto am = shapes.autoep_maps.params.find(name); am != shapes.autoep_maps.params.end()) {
        const auto layer = std::find_if(shapes.autoep_layers.begin(), shapes.autoep_layers.end(), [&](const auto& l) {
          return name.rfind(l.prefix + ".", 0) == 0 && name.find('.', l.prefix.size() + 1) == std::string::npos;
        });
        if (layer == shapes.autoep_layers.end())
          return corrupt(fmt::format("{}: AutoEP's map of '{}', which is under no layer's expert_key_prefix", mw, name));
        OPTSTATE_ASSIGN_OR_RETURN(out.autoep[name],
                                  autoep_whole_shape(name, shape, *r0.groups[g].ep_size, *layer, am->second, mw));
        continue;
      }
      const auto m = name.find(marker);
      const size_t digits = m == std::string::npos ? 0 : m + marker.size();
      size_t end = digits;
      while (end < name.size() && end - digits < 7 && name[end] >= '0' && name[end] <= '9') ++end;
      if (m == std::string::npos || end == digits || end >= name.size() || name[end] != '.')
        return corrupt(fmt::format("{} param group {}: '{}' in a group of experts ('moe'), but not an expert of a "
                                   "DeepSpeed MoE layer (<layer>.{}<i>.<param>)", mw, r0.groups[g].param_group, name,
                                   marker));
      const std::string prefix = name.substr(0, digits);
      const int64_t i = std::stoll(name.substr(digits, end - digits));
      const int64_t ep = *r0.groups[g].ep_size;
      auto [at, fresh] = layer_of.emplace(prefix, out.layers.size());
      if (fresh) out.layers.push_back({prefix, ep, 0});
      if (out.layers[at->second].ep_size != ep)
        return corrupt(fmt::format("{}: MoE layer '{}' has experts in groups of expert-parallel sizes {} and {}", mw,
                                   prefix, out.layers[at->second].ep_size, ep));
      ids[prefix].insert(i);
      out.local[name] = {prefix, {i, name.substr(end)}};
    }
  }
  std::vector<int64_t> held, want = shapes.num_experts;
  for (const ZeroShapes::AutoEpLayer& layer : shapes.autoep_layers) held.push_back(layer.num_experts);
  for (ZeroExperts::Layer& layer : out.layers) {
    const auto& local = ids[layer.prefix];
    layer.local_experts = static_cast<int64_t>(local.size());
    if (*local.rbegin() != layer.local_experts - 1)
      return corrupt(fmt::format("{}: MoE layer '{}' lists local experts {}, not 0 to {}", mw, layer.prefix,
                                 fmt::join(local, ", "), layer.local_experts - 1));
    held.push_back(layer.local_experts * layer.ep_size);
  }
  std::sort(held.begin(), held.end());
  std::sort(want.begin(), want.end());
  if (held != want)
    return corrupt(fmt::format("{}: num_experts [{}] by MoE layer, but the groups of experts hold layers of [{}] "
                               "experts (local experts times expert-parallel size; AutoEP's num_experts)", mw,
                               fmt::join(shapes.num_experts, ", "), fmt::join(held, ", ")));
  // Every layer's expert files, and no others: a checkpoint DeepSpeed would resume from.
  for (size_t l = 0; l < shapes.num_experts.size(); ++l) {
    const auto files = z.expert_files.find(static_cast<int64_t>(l));
    for (int64_t e = 0; e < shapes.num_experts[l]; ++e)
      if (files == z.expert_files.end() || !files->second.count(e))
        return corrupt(fmt::format("{}: no layer_{}_expert_{}_mp_rank_00_model_states.pt (MoE layer {} of {} "
                                   "experts, num_experts in {})", z.dir.string(), l, e, l, shapes.num_experts[l], mw));
    out.experts += shapes.num_experts[l];
  }
  for (const auto& [l, es] : z.expert_files)
    if (l < 0 || static_cast<size_t>(l) >= shapes.num_experts.size() || *es.rbegin() >= shapes.num_experts[l])
      return corrupt(fmt::format("{}: layer_{}_expert_{}_mp_rank_00_model_states.pt, past the {} MoE layers' experts "
                                 "num_experts [{}] in {} lists", z.dir.string(), l, *es.rbegin(),
                                 shapes.num_experts.size(), fmt::join(shapes.num_experts, ", "), mw));
  return out;
}

auto TorchSaveReader::align_moe_groups(ZeroRank& zr, const ZeroRank& r0, const ZeroShapes& shapes,
                                       const std::string& wf) -> Status {
  const size_t n = r0.groups.size();
  if (zr.stage == 3 || zr.groups.size() != n || shapes.groups.size() != n) return Status::Ok();  // refused after
  if (std::none_of(zr.groups.begin(), zr.groups.end(), [](const ZeroGroup& zg) { return zg.ep_size; }))
    return Status::Ok();
  std::vector<std::set<size_t>> candidates(n);
  std::set<size_t> taken;
  for (size_t j = 0; j < n; ++j) {
    const ZeroGroup& zg = zr.groups[j];
    if (!zg.ep_size) {
      candidates[j] = {j};
      continue;
    }
    for (size_t g = 0; g < n; ++g) {
      if (r0.groups[g].ep_size != zg.ep_size) continue;
      Hyperparameters x = zg.group.hyper, y = r0.groups[g].group.hyper;
      x.lr = y.lr = 0;  // compared once aligned, as read
      if (!(x == y)) continue;
      std::set<std::string> names;
      for (const auto& [name, shape] : shapes.groups[g]) names.insert(name);
      if (std::all_of(zg.fragments.begin(), zg.fragments.end(), [&](const ZeroFragment& fr) {
            return names.count(fr.name) > 0;
          }))
        candidates[j].insert(g);
    }
  }
  std::vector<std::optional<size_t>> to(n);
  for (bool progress = true; progress;) {
    progress = false;
    for (size_t j = 0; j < n; ++j) {
      if (to[j]) continue;
      for (const size_t t : taken) candidates[j].erase(t);
      if (candidates[j].size() == 1) {
        to[j] = *candidates[j].begin();
        taken.insert(*to[j]);
        progress = true;
      }
    }
  }
  for (size_t j = 0; j < n; ++j) {
    if (to[j]) continue;
    for (const size_t t : taken) candidates[j].erase(t);
    if (candidates[j].empty())
      return corrupt(fmt::format("{} flat param {}: a group of experts (ep_size_{}) that is none of rank 0's file's "
                                 "of its expert-parallel size, settings and params", wf, j,
                                 zr.groups[j].ep_size.value_or(0)));
    to[j] = *candidates[j].begin();
    taken.insert(*to[j]);
  }
  std::vector<ZeroGroup> groups(n);
  for (size_t j = 0; j < n; ++j) {
    groups[*to[j]] = std::move(zr.groups[j]);
    groups[*to[j]].param_group = r0.groups[*to[j]].param_group;
  }
  zr.groups = std::move(groups);
  return Status::Ok();
}

auto TorchSaveReader::read_layer_shapes(const ZeroFiles& z) -> Result<LayerShapes> {
  LayerShapes layers;
  std::error_code ec;
  size_t seen = 0;
  for (fs::directory_iterator it(z.dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (++seen > (size_t{1} << 20)) return corrupt(z.dir.string() + ": more than 2^20 entries");
    const std::string name = it->path().filename().string();
    const auto tp = zero_layer_name(name);
    if (!tp) continue;
    if (*tp != -1)
      return unsupported(fmt::format("{}: a tensor-parallel rank's layer file beside a pipeline under bf16 without "
                                     "ZeRO (Megatron-DeepSpeed's tensor parallelism): not read", it->path().string()));
    const int64_t layer = std::stoll(name.substr(6, name.size() - 6 - 16));  // layer_<L>-model_states.pt
    OPTSTATE_ASSIGN_OR_RETURN(auto ap, open_archive(it->path()));
    OPTSTATE_ASSIGN_OR_RETURN(const ModelDict md, interpret_model_dict(ap.second, it->path().string()));
    auto& keys = layers[layer];
    for (const ModelTensor& t : md.tensors) keys[t.name] = t.dtensor ? t.dtensor->global_shape : t.tensor.shape;
  }
  if (ec) return io_error(fmt::format("{}: {}", z.dir.string(), ec.message()));
  return layers;
}

auto TorchSaveReader::shapes_from_layer_files(const ZeroFiles& z, const std::vector<ZeroRank>& ranks,
                                              ZeroShapes& shapes, const std::string& mw, bool pipeline) -> Status {
  if (!pipeline || z.layer_files == 0)
    return corrupt(mw + ": param_shapes is None and the optimizer's state_dict is beside it: DeepSpeed without ZeRO "
                        "whose bf16_zero_pp_rank_* files name no param's shape, and no pipeline layer files "
                        "(layer_*-model_states.pt) to take the shapes from: not read");
  // The layer files are read once for every stage (each stage's slice calls this).
  if (!layer_shapes_) {
    OPTSTATE_ASSIGN_OR_RETURN(layer_shapes_, read_layer_shapes(z));
  }
  const auto& layers = *layer_shapes_;
  auto layer_file = [](int64_t layer) { return fmt::format("layer_{:02d}-model_states.pt", layer); };
  auto shape_of = [&](const std::string& name, int64_t numel) -> Result<std::vector<int64_t>> {
    const std::string pw = fmt::format("{}: '{}' (param_shapes is None)", mw, name);
    constexpr std::string_view tied = "tied_modules.";
    if (name.starts_with(tied)) {
      const size_t dot = name.find('.', tied.size());
      if (dot == std::string::npos || dot + 1 >= name.size())
        return corrupt(pw + ": a tied module's param is named 'tied_modules.<name>.<key>'");
      const std::string key = name.substr(dot + 1);
      std::map<std::vector<int64_t>, int64_t> found;  // shape -> a layer holding it
      for (const auto& [layer, keys] : layers) {
        const auto k = keys.find(key);
        if (k == keys.end()) continue;
        const auto n = checked_numel(k->second);
        if (n.ok() && *n == numel) found.emplace(k->second, layer);
      }
      if (found.empty())
        return corrupt(fmt::format("{}: no pipeline layer file holds a '{}' of its {} elements", pw, key, numel));
      if (found.size() > 1)
        return corrupt(fmt::format("{}: {} and {} hold a '{}' of its {} elements, shaped {} and {}: which is the tied "
                                   "module's cannot be told", pw, layer_file(found.begin()->second),
                                   layer_file(std::next(found.begin())->second), key, numel,
                                   format_shape(found.begin()->first), format_shape(std::next(found.begin())->first)));
      return found.begin()->first;
    }
    const size_t dot = name.find('.');
    const std::string digits = dot == std::string::npos ? "" : name.substr(0, dot);
    if (digits.empty() || digits.size() > 7 || !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
      return unsupported(pw + ": not a pipeline layer's param ('<layer>.<key>' or 'tied_modules.<name>.<key>'), "
                              "whose shape a layer file would give");
    const int64_t layer = std::stoll(digits);
    const std::string key = name.substr(dot + 1);
    const auto l = layers.find(layer);
    if (l == layers.end()) return corrupt(fmt::format("{}: no {} in {}", pw, layer_file(layer), z.dir.string()));
    const auto k = l->second.find(key);
    if (k == l->second.end()) return corrupt(fmt::format("{}: {} holds no '{}'", pw, layer_file(layer), key));
    return k->second;
  };
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  shapes.groups.clear();
  for (size_t g = 0; g < ranks[0].groups.size(); ++g) {
    std::map<std::string, std::pair<int64_t, int64_t>> runs;  // name -> (first element in the group, elements)
    int64_t offset = 0;
    for (const ZeroRank& zr : ranks) {
      const ZeroGroup& zg = zr.groups.at(g);
      for (const ZeroFragment& fr : zg.fragments) {
        if (fr.start < 0 || fr.numel < 0 || fr.start > kMax - offset) return corrupt(mw + ": a fragment past any file");
        auto [it, fresh] = runs.try_emplace(fr.name, offset + fr.start, 0);
        it->second.first = std::min(it->second.first, offset + fr.start);
        if (fr.numel > kMax - it->second.second) return corrupt(mw + ": a fragment past any file");
        it->second.second += fr.numel;
      }
      const int64_t part = zg.master.shape.empty() ? 0 : zg.master.shape[0];
      if (part < 0 || part > kMax - offset) return corrupt(mw + ": a partition past any file");
      offset += part;
    }
    std::vector<std::tuple<int64_t, std::string, int64_t>> order;
    for (const auto& [name, run] : runs) order.emplace_back(run.first, name, run.second);
    std::sort(order.begin(), order.end());
    auto& params = shapes.groups.emplace_back();
    for (const auto& [at, name, numel] : order) {
      OPTSTATE_ASSIGN_OR_RETURN(auto shape, shape_of(name, numel));
      params.emplace_back(name, std::move(shape));
    }
  }
  const std::string note = "DeepSpeed's pipeline without ZeRO (BF16_Optimizer) saves no param_shapes: each param's "
                           "shape read from the pipeline's layer files (layer_<L>-model_states.pt; a tied module's "
                           "from the layer files holding a tensor of its name and size)";
  if (std::find(value_notes_.begin(), value_notes_.end(), note) == value_notes_.end()) value_notes_.push_back(note);
  return Status::Ok();
}

auto TorchSaveReader::read_zero_slice(const ZeroFiles& z, size_t st) -> Result<ZeroSlice> {
  const ZeroStage& zs = z.stages[st];
  const bool pipeline = (z.stages.size() > 1 || z.layer_files > 0) && !z.tensor_parallel;
  const std::string slice_name = z.tensor_parallel ? "tensor-parallel rank" : "pipeline stage";
  const size_t world = zs.optim.size(), base = files_.size();
  std::vector<ZeroRank> ranks;
  for (const fs::path& f : zs.optim) {
    OPTSTATE_ASSIGN_OR_RETURN(auto ap, open_archive(f));
    files_.push_back(std::move(ap.first));
    OPTSTATE_ASSIGN_OR_RETURN(ZeroRank zr, interpret_zero_optim(ap.second, f.string()));
    ranks.push_back(std::move(zr));
  }
  const ZeroRank& r0 = ranks[0];
  const bool stage3 = r0.stage == 3;
  if (pipeline && stage3)
    return corrupt(zs.optim[0].string() + ": ZeRO stage 3 beside pipeline layer files (DeepSpeed's pipeline takes "
                                          "stages 0 and 1)");
  OPTSTATE_ASSIGN_OR_RETURN(auto model, open_archive(zs.model));
  const std::string mw = zs.model.string();
  ZeroSlice out;
  OPTSTATE_ASSIGN_OR_RETURN(out.shapes, interpret_zero_model(model.second, mw));
  if (out.shapes.without_zero) OPTSTATE_RETURN_IF_ERROR(shapes_from_layer_files(z, ranks, out.shapes, mw, pipeline));
  const ZeroShapes& shapes = out.shapes;
  if (shapes.groups.size() != r0.groups.size())
    return corrupt(fmt::format("{}: {} flat params in param_shapes, {} in the optimizer's files", mw,
                               shapes.groups.size(), r0.groups.size()));
  for (size_t f = 1; f < world; ++f)
    OPTSTATE_RETURN_IF_ERROR(align_moe_groups(ranks[f], r0, shapes, zs.optim[f].string()));
  for (size_t f = 0; f < world; ++f) {
    const ZeroRank& zr = ranks[f];
    const std::string wf = zs.optim[f].string();
    if (zr.partitions != static_cast<int64_t>(world))
      return corrupt(fmt::format("{}: partition_count {}, but {} holds {} ranks' optimizer files{}", wf, zr.partitions,
                                 z.dir.string(), world,
                                 z.stages.size() > 1 ? fmt::format(" of {} {}", slice_name, st) : ""));
    if ((zr.stage == 3) != stage3 || zr.param_groups != r0.param_groups || zr.groups.size() != r0.groups.size())
      return corrupt(fmt::format("{}: ZeRO stage {} with {} param groups ({} flat params), rank 0's file stage {} with "
                                 "{} ({})", wf, zr.stage, zr.param_groups, zr.groups.size(), r0.stage,
                                 r0.param_groups, r0.groups.size()));
    for (size_t g = 0; g < zr.groups.size(); ++g) {
      std::set<std::string> a, b;
      for (const auto& [n, t] : zr.groups[g].moments) a.insert(n);
      for (const auto& [n, t] : r0.groups[g].moments) b.insert(n);
      Hyperparameters x = zr.groups[g].group.hyper, y = r0.groups[g].group.hyper;
      x.lr = y.lr = 0;  // compared below, as read
      if (a != b || !(x == y) || zr.groups[g].param_group != r0.groups[g].param_group ||
          zr.groups[g].ep_size != r0.groups[g].ep_size)
        return corrupt(fmt::format("{} flat param {}: group, moments or hyperparameters other than rank 0's file's", wf, g));
    }
  }
  // What DeepSpeed 0.15+ records of the grid (older ones record only mp_world_size: pp x tp).
  const auto slices = static_cast<int64_t>(z.stages.size());
  const int64_t want_tp = z.tensor_parallel ? slices : 1, want_pp = pipeline ? slices : 1;
  if (shapes.tp_degree && *shapes.tp_degree != want_tp)
    return corrupt(fmt::format("{}: tp_degree {}, but {} holds {} model-parallel ranks' files{}", mw,
                               *shapes.tp_degree, z.dir.string(), slices,
                               z.layer_files ? " and a pipeline's layer files" : ""));
  if ((shapes.pp_degree && *shapes.pp_degree != want_pp) || (shapes.mp_world_size && *shapes.mp_world_size != slices))
    return corrupt(fmt::format("{}: {} model-parallel ranks (pp_degree {}), but {} holds {} {}s' files", mw,
                               shapes.mp_world_size.value_or(-1), shapes.pp_degree.value_or(-1), z.dir.string(),
                               slices, pipeline ? "stage" : "rank"));
  std::vector<double> decay(r0.param_groups);
  for (const ZeroGroup& zg : r0.groups) decay[zg.param_group] = zg.group.hyper.weight_decay;
  OPTSTATE_RETURN_IF_ERROR(check_zero_decay(shapes, decay, mw));
  OPTSTATE_ASSIGN_OR_RETURN(const ZeroExperts experts, zero_experts(z, r0, shapes, mw));
  for (const auto& lines : {shapes.not_read, r0.not_read})
    for (const std::string& n : lines)
      if (std::find(not_read_.begin(), not_read_.end(), n) == not_read_.end()) not_read_.push_back(n);
  bool bnb_partitions = false;  // some moments are bitsandbytes' 8-bit codes
  out.hyper.resize(r0.param_groups);
  out.step.resize(r0.param_groups);
  for (const ZeroGroup& zg : r0.groups) out.hyper[zg.param_group] = zg.group.hyper;
  std::vector<double> lr_of(r0.param_groups, 0.0);
  // Each flat param (g): a param group's, or under ZeRO-3 one of its sub-groups, in group order.
  for (size_t g = 0; g < r0.groups.size(); ++g) {
    const size_t pg = r0.groups[g].param_group;
    const std::string gw = z.stages.size() > 1 ? fmt::format("{} {} {} param group {}", z.dir.string(), slice_name, st, pg)
                                               : fmt::format("{} param group {}", z.dir.string(), pg);
    std::optional<int64_t> step;  // this flat param's
    for (size_t f = 0; f < world; ++f) {
      const ZeroGroup& zg = ranks[f].groups[g];
      const std::string fw = fmt::format("{} param group {}{}", zs.optim[f].string(), pg,
                                         r0.groups.size() == r0.param_groups ? "" : fmt::format(" flat param {}", g));
      OPTSTATE_ASSIGN_OR_RETURN(const double lr, value_of(base + f, zg.group.lr, fw + " 'lr'"));
      OPTSTATE_ASSIGN_OR_RETURN(const double sv, value_of(base + f, zg.step, fw + " 'step'"));
      if (!(sv >= 0 && sv < 9.2e18) || sv != std::floor(sv)) return corrupt(fmt::format("{}: step {} is not a count", fw, sv));
      if (f == 0) {
        if (!out.step[pg]) {  // the group's first flat param
          lr_of[pg] = lr;
          out.step[pg] = static_cast<int64_t>(sv);
        }
        step = static_cast<int64_t>(sv);
      }
      if (lr != lr_of[pg] || static_cast<int64_t>(sv) != *step)
        return corrupt(fmt::format("{}: lr {} and step {}, rank 0's file {} and {}", fw, lr, sv, lr_of[pg], *step));
    }
    out.hyper[pg].lr = lr_of[pg];
    // Every rank's runs of each param: (rank, first element in the rank's partition, count).
    // An MoE group's params are each expert-parallel rank's own experts, named as its local ones:
    // read per expert-parallel rank from its expert-data-parallel ranks, under global names.
    const auto& local_params = shapes.groups[g];
    const std::optional<int64_t> ep = r0.groups[g].ep_size;
    std::vector<std::pair<std::string, std::vector<int64_t>>> params;  // as read: global names
    std::vector<std::pair<std::vector<size_t>, std::map<std::string, std::string>>> shares;  // holders, local -> read
    std::map<std::string, size_t> share_of;  // an expert's global name -> its expert-parallel rank
    if (!ep) {
      params = local_params;
      std::vector<size_t> all(world);
      std::iota(all.begin(), all.end(), size_t{0});
      std::map<std::string, std::string> same;
      for (const auto& [name, shape] : local_params) same[name] = name;
      shares.emplace_back(std::move(all), std::move(same));
    } else {
      const auto e_size = static_cast<size_t>(*ep), edp = world / e_size;
      for (size_t e = 0; e < e_size; ++e) {
        std::vector<size_t> holders;
        for (size_t k = 0; k < edp; ++k) holders.push_back(shapes.data_before_expert ? e * edp + k : e + k * e_size);
        shares.emplace_back(std::move(holders), std::map<std::string, std::string>{});
      }
      // AutoEP's fused experts: each expert-parallel rank's shard is the next block of the whole.
      for (const auto& [name, shape] : local_params) {
        const auto whole = experts.autoep.find(name);
        if (whole == experts.autoep.end()) continue;
        for (size_t e = 0; e < e_size; ++e) shares[e].second[name] = name;
        params.emplace_back(name, whole->second);
      }
      // Layer by layer (in the group's order), each expert-parallel rank's experts in turn.
      for (const ZeroExperts::Layer& layer : experts.layers)
        for (size_t e = 0; e < e_size; ++e)
          for (const auto& [name, shape] : local_params) {
            const auto at = experts.local.find(name);
            if (at == experts.local.end() || at->second.first != layer.prefix) continue;
            const std::string global = layer.prefix + std::to_string(static_cast<int64_t>(e) * layer.local_experts +
                                                                     at->second.second.first) + at->second.second.second;
            shares[e].second[name] = global;
            share_of[global] = e;
            params.emplace_back(global, shape);
          }
    }
    std::map<std::string, std::vector<std::tuple<size_t, int64_t, int64_t>>> runs;
    std::vector<int64_t> partition(world);
    for (size_t f = 0; f < world; ++f) partition[f] = ranks[f].groups[g].master.shape[0];
    if (stage3) {
      int64_t offset = 0;
      const auto w = static_cast<int64_t>(world);
      for (const auto& [name, shape] : params) {
        const int64_t numel = *checked_numel(shape), part = (numel + w - 1) / w;
        // Checked before it is added: a partition is no larger than its file, so nothing overflows.
        for (size_t f = 0; f < world; ++f)
          if (part > partition[f] - offset)
            return corrupt(fmt::format("{}: '{}' ends past element {} of the flat partition, which holds {}",
                                       zs.optim[f].string(), name, offset, partition[f]));
        for (size_t f = 0; f < world; ++f) {
          const int64_t count = std::clamp<int64_t>(numel - static_cast<int64_t>(f) * part, 0, part);
          if (count > 0) runs[name].emplace_back(f, offset, count);
        }
        offset += part;
      }
    } else {
      for (const auto& [holders, named] : shares)
        for (const size_t f : holders) {
          std::vector<ZeroFragment> frags = ranks[f].groups[g].fragments;
          std::sort(frags.begin(), frags.end(), [](const auto& a, const auto& b) { return a.start < b.start; });
          int64_t end = 0;
          for (const ZeroFragment& fr : frags) {
            const std::string fw = fmt::format("{} param group {} '{}'", zs.optim[f].string(), g, fr.name);
            const auto read_as = named.find(fr.name);
            if (read_as == named.end()) return corrupt(fw + ": mapped, but the model states' param_shapes do not list it");
            if (fr.start < end || fr.numel > partition[f] - fr.start)
              return corrupt(fmt::format("{}: run [{}, {}) overlaps another or leaves the partition of {}", fw,
                                         fr.start, fr.start + fr.numel, partition[f]));
            end = fr.start + fr.numel;
            if (fr.numel > 0) runs[read_as->second].emplace_back(f, fr.start, fr.numel);
          }
        }
    }
    // bitsandbytes' 8-bit moments of this flat param (codes whose blocks count from each rank's
    // partition start): each rank's scales and map, found once for all its params.
    std::map<std::pair<size_t, std::string>, Dequant> dequant;  // (rank, entry)
    for (size_t f = 0; f < world; ++f)
      for (const auto& [entry, q] : ranks[f].groups[g].quant) {
        const std::string qw = fmt::format("{} flat param {} '{}' in {}", gw, g, entry, zs.optim[f].string());
        OPTSTATE_ASSIGN_OR_RETURN(const std::string map, map_name(base + f, q.qmap, qw + " map"));
        OPTSTATE_ASSIGN_OR_RETURN(const QMap m, qmap_from_name(map));
        OPTSTATE_ASSIGN_OR_RETURN(const Stored scales, resolve(base + f, q.absmax, q.absmax.shape[0], qw + " absmax"));
        dequant[{f, entry}] = Dequant{scales, 0, q.block, &qmap_table(m)};
      }
    if (!dequant.empty()) bnb_partitions = true;
    for (const auto& [name, shape] : params) {
      const int64_t numel = *checked_numel(shape);
      const std::string pw = fmt::format("{} '{}'", gw, name);
      int64_t covered = 0;
      for (const auto& [f, local, count] : runs[name]) covered += count;
      if (experts.autoep.count(name)) {  // each expert-parallel rank's runs must be its whole shard
        for (size_t e = 0; e < shares.size(); ++e) {
          int64_t held = 0;
          for (const auto& [f, local, count] : runs[name])
            if (std::count(shares[e].first.begin(), shares[e].first.end(), f)) held += count;
          if (held * static_cast<int64_t>(shares.size()) != numel)
            return corrupt(fmt::format("{}: expert-parallel rank {}'s ranks ({}) hold {} elements of its shard of {}",
                                       pw, e, fmt::join(shares[e].first, ", "), held,
                                       numel / static_cast<int64_t>(shares.size())));
        }
      }
      if (covered != numel)
        return corrupt(fmt::format("{}: the ranks' partitions hold {} of its {} elements{}", pw, covered, numel,
                                   share_of.count(name)
                                       ? fmt::format(" (expert-parallel rank {}: ranks {}, as ds_config's "
                                                     "use_data_before_expert_parallelism {} lays them out)",
                                                     share_of.at(name), fmt::join(shares[share_of.at(name)].first, ", "),
                                                     shapes.data_before_expert)
                                       : ""));
      ZeroSliceParam sp{name, shape, pg, *step, {}};
      std::vector<std::string> entries;
      for (const auto& [n, t] : r0.groups[g].moments) entries.push_back(n);
      entries.push_back(kParam);  // the fp32 master weights
      for (const std::string& entry : entries) {
        std::vector<Piece> pieces;
        int64_t begin = 0;
        for (const auto& [f, local, count] : runs[name]) {
          const ZeroGroup& zg = ranks[f].groups[g];
          const dcp::TensorRef& t = entry == kParam ? zg.master : zg.moments.at(entry);
          OPTSTATE_ASSIGN_OR_RETURN(const Stored whole, resolve(base + f, t, t.shape[0],
                                                                fmt::format("{} '{}' in {}", pw, entry,
                                                                            zs.optim[f].string())));
          const auto dq = dequant.find({f, entry});
          const uint64_t elem = dq == dequant.end() ? 4 : 1;  // fp32 values, or 8-bit codes
          Piece pc{begin, count, whole, std::nullopt};
          pc.stored.at += static_cast<uint64_t>(local) * elem;
          pc.stored.bytes = static_cast<uint64_t>(count) * elem;
          pc.stored.whole = whole.whole && pc.stored.bytes == whole.bytes;
          if (dq != dequant.end()) {  // read as fp32 values, map[code] * absmax[block] of the partition
            pc.dq = dq->second;
            pc.dq->local = local;
          }
          pieces.push_back(pc);
          begin += count;
        }
        sp.entries[entry] = std::move(pieces);
      }
      out.params.push_back(std::move(sp));
    }
  }
  const std::string bnb_line = "bitsandbytes' 8-bit encoding of the moments (its AdamW8bit under ZeRO: blocks of each "
                               "rank's flat partition, not of each param): read as fp32 values";
  if (bnb_partitions && std::find(not_read_.begin(), not_read_.end(), bnb_line) == not_read_.end())
    not_read_.push_back(bnb_line);
  return out;
}

auto TorchSaveReader::join_pipeline_stage(const ZeroFiles& z, size_t st, ZeroSlice slice,
                                          std::vector<int64_t>& group_steps,
                                          std::map<std::string, size_t>& stage_of) -> Status {
  const bool pipeline = z.stages.size() > 1 || z.layer_files > 0;
  std::vector<std::optional<size_t>> joined(slice.hyper.size());
  std::set<size_t> taken;  // joined groups this stage's groups took
  auto gw_of = [&](size_t pg) {
    return pipeline ? fmt::format("{} stage {} param group {}", z.dir.string(), st, pg)
                    : fmt::format("{} param group {}", z.dir.string(), pg);
  };
  auto join = [&](size_t pg) -> Result<size_t> {
    if (joined[pg]) return *joined[pg];
    const Hyperparameters& h = slice.hyper[pg];
    size_t j = meta_.groups.size();
    if (st > 0)
      for (size_t k = 0; k < meta_.groups.size(); ++k)
        if (!taken.count(k) && meta_.groups[k].hyper == h) {
          j = k;
          break;
        }
    const int64_t step = slice.step[pg].value_or(0);
    if (j == meta_.groups.size()) {
      ParamGroup group;
      group.hyper = h;
      meta_.groups.push_back(std::move(group));
      group_steps.push_back(step);
    } else if (group_steps[j] != step) {
      return corrupt(fmt::format("{}: step {}, and the group of the same settings of an earlier pipeline stage step {}",
                                 gw_of(pg), step, group_steps[j]));
    }
    taken.insert(j);
    joined[pg] = j;
    return j;
  };
  if (st == 0)
    for (size_t pg = 0; pg < slice.hyper.size(); ++pg)
      if (slice.step[pg]) OPTSTATE_RETURN_IF_ERROR(join(pg).status());
  for (ZeroSliceParam& sp : slice.params) {
    const std::string pw = fmt::format("{} '{}'", gw_of(sp.group), sp.name);
    // A name an earlier stage holds: a tied module's copy (TiedLayerSpec), the same tensor.
    const auto earlier = meta_.params.find(sp.name);
    if (earlier != meta_.params.end()) {
      const size_t other = stage_of.at(sp.name);
      if (other == st || earlier->second.shape != sp.shape)
        return corrupt(fmt::format("{}: shape [{}], and '{}' of {} has shape [{}]", pw, fmt::join(sp.shape, ", "),
                                   sp.name, other == st ? "another group" : fmt::format("stage {}", other),
                                   fmt::join(earlier->second.shape, ", ")));
      if (earlier->second.entries.size() != sp.entries.size())
        return corrupt(fmt::format("{}: {} entries, its copy in stage {} {}", pw, sp.entries.size(), other,
                                   earlier->second.entries.size()));
      for (const auto& [entry, pieces] : sp.entries)
        if (!earlier->second.entries.count(entry))
          return corrupt(fmt::format("{}: '{}', which its copy in stage {} has not", pw, entry, other));
      if (earlier->second.step != sp.step)
        return corrupt(fmt::format("{}: step {}, its copy in stage {} step {}", pw, sp.step, other, earlier->second.step));
      for (auto& [entry, pieces] : sp.entries) zero_copies_.push_back({sp.name, entry, st, std::move(pieces)});
      continue;
    }
    OPTSTATE_ASSIGN_OR_RETURN(const size_t j, join(sp.group));
    ParamState ps;
    ps.shape = sp.shape;
    ps.group = static_cast<int>(j);
    ps.step = sp.step;
    for (auto& [entry, pieces] : sp.entries) {
      stored_[{sp.name, entry, Component::kValues}] = std::move(pieces);
      ps.entries.emplace(entry, Entry{});  // fp32 values
    }
    meta_.groups[j].params.push_back(sp.name);
    meta_.params.emplace(sp.name, std::move(ps));
    stage_of[sp.name] = st;
  }
  return Status::Ok();
}

auto TorchSaveReader::join_tensor_parallel(const ZeroFiles& z, std::vector<ZeroSlice>& slices) -> Status {
  const size_t tp = slices.size();
  const std::string mw = z.stages[0].model.string();
  const ZeroShapes& s0 = slices[0].shapes;
  if (!s0.autotp)
    return corrupt(fmt::format(
        "{}: {} tensor-parallel ranks' files, and no affine_map in universal_checkpoint_info ({}): the shards' "
        "layout is in no file, not read", mw, tp,
        s0.uc_info ? "its name patterns, Megatron-DeepSpeed's or AutoTP's before DeepSpeed recorded affine maps, say "
                     "along which dim some params are split, not where each rank's shard lies nor which params "
                     "every rank holds whole"
                   : "DeepSpeed's AutoTP records one, which says where each rank's shard lies; there is none"));
  const AutoTpMaps& maps = *s0.autotp;
  for (size_t r = 1; r < tp; ++r) {
    const ZeroSlice& sr = slices[r];
    const std::string rw = z.stages[r].model.string();
    if (sr.hyper.size() != slices[0].hyper.size() || sr.params.size() != slices[0].params.size())
      return corrupt(fmt::format("{}: {} param groups and {} params, tensor-parallel rank 0's {} and {}", rw,
                                 sr.hyper.size(), sr.params.size(), slices[0].hyper.size(), slices[0].params.size()));
    for (size_t g = 0; g < sr.hyper.size(); ++g)
      if (!(sr.hyper[g] == slices[0].hyper[g]) || sr.step[g] != slices[0].step[g])
        return corrupt(fmt::format("{}: param group {}'s settings or step differ from tensor-parallel rank 0's", rw, g));
  }
  for (size_t g = 0; g < slices[0].hyper.size(); ++g) {
    ParamGroup group;
    group.hyper = slices[0].hyper[g];
    meta_.groups.push_back(std::move(group));
  }
  constexpr int64_t kMaxRuns = int64_t{1} << 24;  // runs of one entry
  for (size_t i = 0; i < slices[0].params.size(); ++i) {
    const ZeroSliceParam& p0 = slices[0].params[i];
    const std::string pw = fmt::format("{} '{}'", z.dir.string(), p0.name);
    if (const auto un = maps.unsupported.find(p0.name); un != maps.unsupported.end())
      return corrupt(fmt::format("{}: DeepSpeed's AutoTP could not describe its shards ({}): not read", pw, un->second));
    const auto mi = maps.params.find(p0.name);
    if (mi == maps.params.end()) return corrupt(fmt::format("{}: no affine map in {}", pw, mw));
    const AffineMap& m = mi->second;
    OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(m.logical_shape));
    // Each rank's runs: (first element in the whole tensor, first in the rank's shard, count).
    struct Run {
      int64_t whole, shard, count;
      size_t rank;
      bool copy;  // a block an earlier rank of its locations holds too
    };
    std::vector<Run> runs;
    for (size_t r = 0; r < tp; ++r) {
      const ZeroSliceParam& pr = slices[r].params[i];
      const std::string rw = fmt::format("{} (tensor-parallel rank {})", pw, r);
      if (pr.name != p0.name || pr.group != p0.group || pr.step != p0.step || pr.entries.size() != p0.entries.size())
        return corrupt(fmt::format("{}: '{}' of group {} at step {} where rank 0 has this param of group {} at step {}",
                                   rw, pr.name, pr.group, pr.step, p0.group, p0.step));
      const auto ar = m.ranks.find(static_cast<int64_t>(r));
      if (ar == m.ranks.end() || ar->second.shard_shape != pr.shape)
        return corrupt(fmt::format("{}: shard [{}] in param_shapes, the affine map's [{}]", rw, fmt::join(pr.shape, ", "),
                                   ar == m.ranks.end() ? "no entry" : fmt::format("{}", fmt::join(ar->second.shard_shape, ", "))));
      const int64_t shard_numel = *checked_numel(pr.shape);
      for (const AffinePiece& pc : ar->second.pieces) {
        if (pc.scale != 1.0)
          return corrupt(fmt::format("{}: a piece held times {} (DeepSpeed's scaled pieces, whose moments and settings "
                                     "would need rescaling, which DeepSpeed itself refuses): not read", rw, pc.scale));
        if (std::find(pc.locations.begin(), pc.locations.end(), static_cast<int64_t>(r)) == pc.locations.end())
          return corrupt(fmt::format("{}: a piece of rank {}'s map whose locations do not name it", rw, r));
        const bool copy = *std::min_element(pc.locations.begin(), pc.locations.end()) != static_cast<int64_t>(r);
        OPTSTATE_RETURN_IF_ERROR(affine_runs(pc, numel, shard_numel, rw,
                                             [&](int64_t whole, int64_t shard, int64_t count) -> Status {
          if (!runs.empty()) {
            Run& last = runs.back();
            if (last.rank == r && last.copy == copy && last.whole + last.count == whole &&
                last.shard + last.count == shard) {
              last.count += count;
              return Status::Ok();
            }
          }
          if (static_cast<int64_t>(runs.size()) >= kMaxRuns)
            return corrupt(fmt::format("{}: more than 2^24 runs", rw));
          runs.push_back({whole, shard, count, r, copy});
          return Status::Ok();
        }));
      }
    }
    // The blocks read cover the whole tensor once.
    std::vector<size_t> order;
    for (size_t k = 0; k < runs.size(); ++k)
      if (!runs[k].copy) order.push_back(k);
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return runs[a].whole < runs[b].whole; });
    int64_t end = 0;
    for (size_t k : order) {
      if (runs[k].whole != end)
        return corrupt(fmt::format("{}: the affine map's pieces {} element {} of the whole tensor", pw,
                                   runs[k].whole < end ? "cover twice" : "leave out", std::min(end, runs[k].whole)));
      end += runs[k].count;
    }
    if (end != numel)
      return corrupt(fmt::format("{}: the affine map's pieces cover {} of its {} elements", pw, end, numel));
    // and each rank's pieces its shard once: no shard element read for two places
    std::vector<size_t> by_shard(runs.size());
    std::iota(by_shard.begin(), by_shard.end(), size_t{0});
    std::sort(by_shard.begin(), by_shard.end(), [&](size_t a, size_t b) {
      return std::pair(runs[a].rank, runs[a].shard) < std::pair(runs[b].rank, runs[b].shard);
    });
    std::vector<int64_t> read_of(tp, 0);  // each rank's shard elements read, in order
    for (size_t k : by_shard) {
      const Run& run = runs[k];
      if (run.shard != read_of[run.rank])
        return corrupt(fmt::format("{} (tensor-parallel rank {}): the affine map's pieces {} element {} of its shard",
                                   pw, run.rank, run.shard < read_of[run.rank] ? "read twice" : "leave out",
                                   std::min(read_of[run.rank], run.shard)));
      read_of[run.rank] += run.count;
    }
    for (size_t r = 0; r < tp; ++r)
      if (read_of[r] != *checked_numel(slices[r].params[i].shape))
        return corrupt(fmt::format("{} (tensor-parallel rank {}): the affine map's pieces read {} of its shard's {} "
                                   "elements", pw, r, read_of[r], *checked_numel(slices[r].params[i].shape)));
    ParamState ps;
    ps.shape = m.logical_shape;
    ps.group = static_cast<int>(p0.group);
    ps.step = p0.step;
    for (const auto& entry_pieces : p0.entries) {
      const std::string& entry = entry_pieces.first;  // not a structured binding: clang 14 cannot capture one
      // A run of shard elements [shard, shard + count) of rank r, as the pieces of its slice.
      auto place = [&](const Run& run, std::vector<Piece>& out) -> Status {
        const std::vector<Piece>& local = slices[run.rank].params[i].entries.at(entry);
        auto it = std::upper_bound(local.begin(), local.end(), run.shard,
                                   [](int64_t at, const Piece& pc) { return at < pc.begin; });
        if (it == local.begin()) return internal_error(pw + ": a run before the shard's first piece");
        --it;
        for (int64_t at = run.shard; at < run.shard + run.count; ++it) {
          if (it == local.end() || at < it->begin || at >= it->begin + it->count)
            return corrupt(fmt::format("{} '{}': tensor-parallel rank {}'s shard holds no element {}", pw, entry,
                                       run.rank, at));
          if (it->dq || it->stored.permuted)
            return corrupt(fmt::format("{} '{}': 8-bit moments under AutoTP are not read", pw, entry));
          const int64_t n = std::min(run.shard + run.count, it->begin + it->count) - at;
          Piece pc{run.whole + (at - run.shard), n, it->stored, std::nullopt};
          pc.stored.at += static_cast<uint64_t>(at - it->begin) * 4;
          pc.stored.bytes = static_cast<uint64_t>(n) * 4;
          pc.stored.whole = it->stored.whole && pc.stored.bytes == it->stored.bytes;
          out.push_back(pc);
          at += n;
        }
        return Status::Ok();
      };
      std::vector<Piece> pieces;
      for (size_t k : order) OPTSTATE_RETURN_IF_ERROR(place(runs[k], pieces));
      for (size_t r = 1; r < tp; ++r) {
        std::vector<Piece> copies;
        for (const Run& run : runs)
          if (run.copy && run.rank == r) OPTSTATE_RETURN_IF_ERROR(place(run, copies));
        if (!copies.empty()) zero_copies_.push_back({p0.name, entry, r, std::move(copies)});
      }
      stored_[{p0.name, entry, Component::kValues}] = std::move(pieces);
      ps.entries.emplace(entry, Entry{});  // fp32 values
    }
    meta_.groups[p0.group].params.push_back(p0.name);
    meta_.params.emplace(p0.name, std::move(ps));
  }
  value_notes_.push_back(fmt::format("{} tensor-parallel ranks (DeepSpeed's AutoTP): each param's shards put together "
                                     "where the affine map of {} places them; the blocks several ranks hold are read "
                                     "from the first, and validate compares the others' copies", tp, mw));
  return Status::Ok();
}

template <typename Emit>
auto TorchSaveReader::affine_runs(const AffinePiece& pc, int64_t numel, int64_t shard_numel, const std::string& where,
                                  Emit&& emit) -> Status {
  const size_t n = pc.shape.size();
  int64_t total = 1;
  for (int64_t d : pc.shape) {
    if (d < 0) return corrupt(where + ": a piece of negative size");
    if (d == 0) return Status::Ok();
    if (total > (int64_t{1} << 40) / d) return corrupt(where + ": a piece past 2^40 elements");
    total *= d;
  }
  // Bounds: the extremes of each side's offsets (strides may be negative) within the tensor.
  auto check_side = [&](int64_t offset, const std::vector<int64_t>& strides, int64_t limit, const char* side) -> Status {
    __int128 lo = offset, hi = offset;
    for (size_t k = 0; k < n; ++k) {
      const __int128 span = static_cast<__int128>(strides[k]) * (pc.shape[k] - 1);
      (span < 0 ? lo : hi) += span;
    }
    if (lo < 0 || hi >= limit)
      return corrupt(fmt::format("{}: a piece reaching past the {} tensor's {} elements", where, side, limit));
    return Status::Ok();
  };
  OPTSTATE_RETURN_IF_ERROR(check_side(pc.source_offset, pc.source_strides, numel, "whole"));
  OPTSTATE_RETURN_IF_ERROR(check_side(pc.dest_offset, pc.dest_strides, shard_numel, "shard"));
  const bool rows = n > 0 && pc.source_strides[n - 1] == 1 && pc.dest_strides[n - 1] == 1;
  const int64_t run = rows ? pc.shape[n - 1] : 1;
  const size_t outer = rows ? n - 1 : n;
  std::vector<int64_t> idx(outer, 0);
  for (int64_t emitted = 0; emitted < total; emitted += run) {
    int64_t src = pc.source_offset, dst = pc.dest_offset;
    for (size_t k = 0; k < outer; ++k) {
      src += idx[k] * pc.source_strides[k];
      dst += idx[k] * pc.dest_strides[k];
    }
    OPTSTATE_RETURN_IF_ERROR(emit(src, dst, run));
    for (size_t k = outer; k-- > 0;) {
      if (++idx[k] < pc.shape[k]) break;
      idx[k] = 0;
    }
  }
  return Status::Ok();
}

}  // namespace optstate::torchsave::detail
