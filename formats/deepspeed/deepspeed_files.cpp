// DeepSpeed's checkpoint files: which of them a tag folder holds (ZeRO's per-rank optimizer files,
// the model states, pipeline layers, MoE experts; without ZeRO the model states' optimizer or MoE's
// expp_rank_* files; a universal checkpoint's zero/ folder), their names parsed as DeepSpeed writes
// them, and open_deepspeed, which reads the one it finds with the torch.save driver's reader.
// Layout: FORMAT.md.
#include "torchsave/torchsave_reader_impl.h"

namespace optstate::torchsave {

using detail::tensor_f32;
using detail::TorchSaveReader;
using detail::zero_layer_name;

namespace detail {

// "layer_XX-model_states.pt" (a pipeline's layer, no tensor parallelism): -1;
// "layer_XX-model_YY-model_states.pt" (Megatron-DeepSpeed's, tensor-parallel rank YY): YY; else nullopt.
std::optional<int64_t> zero_layer_name(const std::string& name) {
  constexpr std::string_view head = "layer_", tail = "-model_states.pt", mid = "-model_";
  if (name.rfind(head, 0) != 0 || !name.ends_with(tail) || name.size() <= head.size() + tail.size()) return std::nullopt;
  const std::string body = name.substr(head.size(), name.size() - head.size() - tail.size());
  auto digits = [](std::string_view d) {
    return !d.empty() && d.size() <= 7 && std::all_of(d.begin(), d.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  if (digits(body)) return -1;
  const auto m = body.find(mid);
  if (m == std::string::npos || !digits(std::string_view(body).substr(0, m)) ||
      !digits(std::string_view(body).substr(m + mid.size())))
    return std::nullopt;
  return std::stoll(body.substr(m + mid.size()));
}

}  // namespace detail

namespace {

// A file name's number field: 1 to 7 decimal digits.
std::optional<int64_t> name_number(std::string_view d) {
  if (d.empty() || d.size() > 7 || !std::all_of(d.begin(), d.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return std::nullopt;
  return std::stoll(std::string(d));
}

// "zero_pp_rank_R_mp_rank_MM_optim_states.pt" ("bf16_" before it under bf16): (bf16, R, MM).
std::optional<std::tuple<bool, int64_t, int64_t>> zero_optim_name(std::string name) {
  const bool bf16 = name.rfind("bf16_", 0) == 0;
  if (bf16) name = name.substr(5);
  constexpr std::string_view head = "zero_pp_rank_", mid = "_mp_rank_", tail = "_optim_states.pt";
  if (name.rfind(head, 0) != 0 || !name.ends_with(tail)) return std::nullopt;
  name = name.substr(head.size(), name.size() - head.size() - tail.size());
  const auto m = name.find(mid);
  if (m == std::string::npos) return std::nullopt;
  const auto r = name_number(name.substr(0, m)), mp = name_number(name.substr(m + mid.size()));
  if (!r || !mp) return std::nullopt;
  return std::tuple{bf16, *r, *mp};
}

// The tag folder a `latest` file names (DeepSpeed's save_checkpoint writes it beside the tags), or
// `path` itself.
fs::path zero_tag_dir(const fs::path& path) {
  std::error_code ec;
  const fs::path latest = path / "latest";
  if (!fs::is_regular_file(latest, ec) || fs::file_size(latest, ec) > 256) return path;
  std::ifstream in(latest);
  std::string tag;
  std::getline(in, tag);
  while (!tag.empty() && std::isspace(static_cast<unsigned char>(tag.back()))) tag.pop_back();
  if (tag.empty() || tag == "." || tag == ".." || tag.find('/') != std::string::npos) return path;
  return fs::is_directory(path / tag, ec) ? path / tag : path;
}

// "layer_L_expert_E_mp_rank_MM_model_states.pt" (DeepSpeed MoE: one expert's weights, its global
// number E in MoE layer L): {L, E, MM}; else nullopt.
std::optional<std::array<int64_t, 3>> zero_expert_name(const std::string& name) {
  constexpr std::string_view head = "layer_", mid = "_expert_", mp = "_mp_rank_", tail = "_model_states.pt";
  if (name.rfind(head, 0) != 0 || !name.ends_with(tail)) return std::nullopt;
  const std::string_view body = std::string_view(name).substr(head.size(), name.size() - head.size() - tail.size());
  const auto a = body.find(mid), b = body.find(mp);
  if (a == std::string_view::npos || b == std::string_view::npos || b < a + mid.size()) return std::nullopt;
  const std::string_view parts[] = {body.substr(0, a), body.substr(a + mid.size(), b - a - mid.size()),
                                    body.substr(b + mp.size())};
  std::array<int64_t, 3> out{};
  for (size_t i = 0; i < 3; ++i) {
    if (parts[i].empty() || parts[i].size() > 7 ||
        !std::all_of(parts[i].begin(), parts[i].end(), [](char c) { return c >= '0' && c <= '9'; }))
      return std::nullopt;
    out[i] = std::stoll(std::string(parts[i]));
  }
  return out;
}

}  // namespace

// The ZeRO files of the tag folder at (or named by `latest` in) `path`; nullopt where it holds none.
Result<std::optional<ZeroFiles>> zero_files(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return std::optional<ZeroFiles>{};
  ZeroFiles z;
  z.dir = zero_tag_dir(path);
  std::map<int64_t, std::map<int64_t, fs::path>> files;  // mp rank -> dp rank -> file
  std::set<bool> kinds;
  std::set<int64_t> layer_tp;  // the tensor-parallel ranks layer files name (-1: none)
  std::string expert_mp;       // an expert file of a model-parallel rank other than 0
  size_t seen = 0;
  for (fs::directory_iterator it(z.dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (++seen > (size_t{1} << 20)) return corrupt(z.dir.string() + ": more than 2^20 entries");
    const std::string name = it->path().filename().string();
    if (name.rfind("expp_rank_", 0) == 0 && name.ends_with("_optim_states.pt")) ++z.expert_optim_files;
    if (const auto e = zero_expert_name(name)) {
      if ((*e)[2] != 0) expert_mp = name;
      if (!z.expert_files[(*e)[0]].insert((*e)[1]).second)
        return corrupt(fmt::format("{}: two files of MoE layer {}'s expert {}", z.dir.string(), (*e)[0], (*e)[1]));
      continue;
    }
    if (const auto tp = zero_layer_name(name)) {
      layer_tp.insert(*tp);
      ++z.layer_files;
    }
    const auto parsed = zero_optim_name(name);
    if (!parsed) continue;
    const auto [bf16, rank, mprank] = *parsed;
    kinds.insert(bf16);
    if (!files[mprank].emplace(rank, it->path()).second)
      return corrupt(fmt::format("{}: two optimizer files of rank {} (mp_rank_{:02d})", z.dir.string(), rank, mprank));
  }
  if (ec) return io_error(fmt::format("{}: {}", z.dir.string(), ec.message()));
  if (files.empty() && z.expert_optim_files)
    return invalid_argument(z.dir.string() + ": DeepSpeed MoE without ZeRO (stage 0: each expert-parallel rank's "
                                             "optimizer in expp_rank_*_optim_states.pt), not ZeRO-1/2 partitions: a universal "
                                             "checkpoint is written from those only (DeepSpeed loads no other); "
                                             "optstate reads this one: convert it to another format");
  if (files.empty() && !z.expert_files.empty())
    return corrupt(z.dir.string() + ": DeepSpeed MoE experts' files (layer_*_expert_*) without ZeRO partitions or "
                                    "expp_rank_*_optim_states.pt files (stage 0's optimizer): the optimizer's files are "
                                    "missing");
  if (!expert_mp.empty() || (!z.expert_files.empty() && !files.empty() && files.rbegin()->first > 0))
    return corrupt(fmt::format("{}: {}: DeepSpeed MoE beside model parallelism (a pipeline's stages or tensor-parallel "
                               "ranks, whose experts split other ways): not read", z.dir.string(),
                               expert_mp.empty() ? "experts' files beside mp_rank_01 files" : expert_mp));
  if (files.empty()) {
    if (fs::is_regular_file(z.dir / "mp_rank_00_model_states.pt", ec))
      return invalid_argument(z.dir.string() + ": a DeepSpeed checkpoint without ZeRO (stage 0: the optimizer's "
                                               "state sits in mp_rank_00_model_states.pt, no ZeRO partitions)");
    return std::optional<ZeroFiles>{};
  }
  if (kinds.size() > 1)
    return corrupt(z.dir.string() + ": optimizer files with and without the bf16_ prefix; one run's are alike");
  // Several model-parallel ranks are a pipeline's stages where layer files say so (a PipelineModule
  // saves each layer's weights apart) and none names a tensor-parallel rank; otherwise tensor
  // parallelism (Megatron-DeepSpeed's, DeepSpeed's AutoTP), whose params are split by rules the
  // files do not hold.
  const int64_t last_mp = files.rbegin()->first;
  if (layer_tp.size() > 1 || (!layer_tp.empty() && *layer_tp.begin() >= 0))
    return corrupt(fmt::format("{}: model-parallel ranks (mp_rank_{:02d}, layer files of tensor-parallel ranks): "
                               "Megatron-DeepSpeed's tensor-parallel ZeRO checkpoints are not read (a pipeline's "
                               "stages are, and DeepSpeed's AutoTP ranks)", z.dir.string(), last_mp));
  z.tensor_parallel = layer_tp.empty() && last_mp > 0;
  const size_t world = files.begin()->second.size();
  for (int64_t s = 0; s <= last_mp; ++s) {
    const auto stage = files.find(s);
    if (stage == files.end())
      return corrupt(fmt::format("{}: no optimizer files of pipeline stage {} (zero_pp_rank_*_mp_rank_{:02d}_optim_states.pt) "
                                 "among {} stages' files", z.dir.string(), s, s, last_mp + 1));
    const auto& ranks = stage->second;
    ZeroStage zs;
    for (int64_t r = 0; r < static_cast<int64_t>(std::max(world, ranks.size())); ++r) {
      if (!ranks.count(r))
        return corrupt(fmt::format("{}: no optimizer file of rank {} (zero_pp_rank_{}_mp_rank_{:02d}_optim_states.pt) "
                                   "among {} ranks' files", z.dir.string(), r, r, s, std::max(world, ranks.size())));
      zs.optim.push_back(ranks.at(r));
    }
    const std::string model = fmt::format("mp_rank_{:02d}_model_states.pt", s);
    const std::string zero3 = fmt::format("zero_pp_rank_0_mp_rank_{:02d}_model_states.pt", s);  // ZeRO-3's, per rank
    if (fs::is_regular_file(z.dir / model, ec)) zs.model = z.dir / model;
    else if (fs::is_regular_file(z.dir / zero3, ec)) zs.model = z.dir / zero3;
    if (zs.model.empty())
      return corrupt(fmt::format("{}: no model states file ({}, or ZeRO-3's {}), which names the params",
                                 z.dir.string(), model, zero3));
    z.stages.push_back(std::move(zs));
  }
  return std::optional<ZeroFiles>{std::move(z)};
}

namespace {

// A DeepSpeed universal checkpoint's folder and its model states file: `path` itself, or the folder
// its `latest_universal` names (ds_to_universal writes that file beside its output) where no
// `latest` names a tag folder: DeepSpeed's load_checkpoint follows `latest` unless configured to
// load a universal checkpoint, and a run that went on after a conversion has a newer `latest`
// beside the `latest_universal` of the step converted.
std::optional<std::pair<fs::path, fs::path>> universal_dir(const fs::path& path) {
  std::error_code ec;
  auto at = [&](const fs::path& dir) -> std::optional<std::pair<fs::path, fs::path>> {
    if (!fs::is_regular_file(dir / "zero" / "optimizer_state.pt", ec)) return std::nullopt;
    for (const char* model : {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"})
      if (fs::is_regular_file(dir / model, ec)) return std::pair{dir, dir / model};
    return std::nullopt;
  };
  if (auto u = at(path)) return u;
  if (zero_tag_dir(path) != path) return std::nullopt;
  if (!fs::is_regular_file(path / "latest_universal", ec) || fs::file_size(path / "latest_universal", ec) > 4096)
    return std::nullopt;
  std::ifstream f(path / "latest_universal");
  std::string tag;
  std::getline(f, tag);
  if (tag.empty() || tag.find('/') != std::string::npos || tag == "." || tag == "..") return std::nullopt;
  return at(path / tag);
}

}  // namespace

bool is_deepspeed_checkpoint(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return false;
  if (universal_dir(path)) return true;
  const fs::path dir = zero_tag_dir(path);
  size_t seen = 0;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end && ++seen <= 4096; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    // ZeRO's partitions, or MoE's expert-parallel optimizers without ZeRO (moe_stage0_files)
    if (zero_optim_name(name) || (name.rfind("expp_rank_", 0) == 0 && name.ends_with("_optim_states.pt"))) return true;
  }
  // Stage 0's tag folder (the optimizer inside the model states file: zero_stage0_file).
  return fs::is_regular_file(dir / "mp_rank_00_model_states.pt", ec);
}

Result<ZeroUniversalParts> zero_universal_parts(const fs::path& path) {
  if (universal_dir(path))
    return invalid_argument(path.string() + ": already a universal checkpoint (DeepSpeed loads it on any world size)");
  OPTSTATE_ASSIGN_OR_RETURN(const auto z, zero_files(path));
  if (!z) return invalid_argument(path.string() + ": no DeepSpeed ZeRO optimizer files (zero_pp_rank_*_optim_states.pt)");
  const fs::path& file = z->optim().at(0);
  const std::string where = file.string();
  OPTSTATE_ASSIGN_OR_RETURN(auto opened, open_archive(file));
  const pickle::Pickle& p = opened.second;
  // What the reader makes of it: the stage, and whose optimizer ZeRO wraps.
  OPTSTATE_ASSIGN_OR_RETURN(const ZeroRank zr, interpret_zero_optim(p, where));
  if (zr.stage == 3)
    return invalid_argument(where + ": a ZeRO-3 checkpoint; optstate writes universal checkpoints of ZeRO-1/2 ones");
  // bitsandbytes' optimizer wrapped by ZeRO: a universal checkpoint would hold fp32 moments, which
  // it does not load (ds_to_universal does not convert its state either).
  if (zr.bnb)
    return invalid_argument(where + ": the optimizer DeepSpeed wraps is bitsandbytes' (state1/state2); a universal "
                                    "checkpoint holds fp32 exp_avg/exp_avg_sq, which its optimizer does not load. "
                                    "optstate reads the state (as fp32 moments): convert it to another format");
  const pickle::Ref osd = p.dict_get(p.root(), "optimizer_state_dict");
  const pickle::Ref base = p.dict_get(osd, "base_optimizer_state");
  const pickle::Ref groups = base == pickle::kNoRef ? pickle::kNoRef : p.dict_get(base, "param_groups");
  if (groups == pickle::kNoRef || p.at(groups).kind != pickle::Kind::kList)
    return corrupt(where + ": no base_optimizer_state.param_groups (a list)");
  pickle::Writer w;
  w.empty_dict();
  w.mark();
  const pickle::Refs& items = p.at(osd).items;
  for (size_t k = 0; k + 1 < items.size(); k += 2) {
    const pickle::Value& key = p.at(items[k]);
    if (key.kind == pickle::Kind::kStr && (key.s == "base_optimizer_state" || key.s == "param_slice_mappings" ||
                                           key.s == "single_partition_of_fp32_groups" || key.s == "param_groups"))
      continue;
    OPTSTATE_RETURN_IF_ERROR(pickle::emit(w, p, items[k], where));
    OPTSTATE_RETURN_IF_ERROR(pickle::emit(w, p, items[k + 1], where + " optimizer_state_dict"));
  }
  w.str("param_groups");
  OPTSTATE_RETURN_IF_ERROR(pickle::emit(w, p, groups, where + " param_groups"));
  w.setitems_from_mark();
  ZeroUniversalParts parts{z->dir, z->model(), {}, w.finish(), {}, {}, false, {}};
  for (const ZeroStage& st : z->stages) parts.stage_model_states.push_back(st.model);
  // A step kept as a number (DeepSpeed's CPU Adam: an int); the reader gives a never-stepped flat
  // param the number 0, but then no step.pt is written.
  parts.int_step = !zr.groups.empty() && zr.groups[0].step.number.has_value();

  // The module's tensors that no param group holds: ds_to_universal writes them as fp32.pt too.
  const std::string mw = z->model().string();
  OPTSTATE_ASSIGN_OR_RETURN(auto model, open_archive(z->model()));
  OPTSTATE_ASSIGN_OR_RETURN(const ZeroShapes shapes, interpret_zero_model(model.second, mw));
  // A pipeline's BF16_Optimizer without ZeRO: DeepSpeed (0.19.8) resumes neither its own checkpoint
  // of it nor a universal one (stage 0's load hands the optimizer one dict where it wants a list
  // per rank: KeyError), so none is written.
  if (shapes.without_zero)
    return invalid_argument(mw + ": a pipeline under bf16 without ZeRO (BF16_Optimizer, param_shapes None): DeepSpeed "
                                 "loads no universal checkpoint into it (nor its own checkpoint: its stage-0 load fails); "
                                 "optstate reads the state: convert it to another format");
  // DeepSpeed MoE layers take their experts from layer_*_expert_* files, which a universal
  // checkpoint has none of; AutoEP's universal checkpoint (ds_to_universal's: expert tensors whole,
  // the model states rewritten with the layers' metadata) is read, not written.
  if (!shapes.autoep_layers.empty())
    return invalid_argument(z->dir.string() + ": DeepSpeed AutoEP's experts: its universal checkpoint is "
                                              "ds_to_universal's (which optstate reads), not written by optstate; "
                                              "convert to another format");
  if (!z->expert_files.empty())
    return invalid_argument(z->dir.string() + ": DeepSpeed MoE layers' experts, which DeepSpeed does not load from a "
                                              "universal checkpoint; optstate reads them: convert to another format");
  if (shapes.autotp)  // ds_to_universal writes these whole, with no cat_dim
    for (const auto& [name, m] : shapes.autotp->params) parts.affine_params.insert(name);
  std::set<std::string> grouped;
  for (const auto& group : shapes.groups)
    for (const auto& [name, shape] : group) grouped.insert(name);
  auto refs = std::make_shared<std::vector<dcp::TensorRef>>();
  if (const pickle::Ref module = model.second.dict_get(model.second.root(), "module");
      module != pickle::kNoRef && model.second.at(module).kind != pickle::Kind::kNone) {
    OPTSTATE_ASSIGN_OR_RETURN(const ModelDict md, interpret_model_dict(model.second, module, mw + " ['module']"));
    for (const ModelTensor& t : md.tensors) {
      if (grouped.count(t.name)) continue;
      if (t.dtensor) return corrupt(fmt::format("{} ['module']: '{}' is a DTensor", mw, t.name));
      parts.module_only.push_back({t.name, t.tensor.shape});
      refs->push_back(t.tensor);
    }
  }
  auto archive = std::make_shared<Archive>(std::move(model.first));
  parts.module_values = [archive, refs, mw, names = parts.module_only](size_t i) -> Result<std::vector<float>> {
    if (i >= refs->size()) return internal_error("module tensor index out of range");
    return tensor_f32(*archive, (*refs)[i], fmt::format("{} ['module']['{}']", mw, names[i].name));
  };
  return parts;
}

Result<std::optional<fs::path>> zero_stage0_file(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return std::optional<fs::path>{};
  const fs::path dir = zero_tag_dir(path);
  std::vector<std::string> model_parallel;  // mp_rank_NN (NN > 0) model states, a pipeline's layer files
  size_t seen = 0;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (++seen > (size_t{1} << 20)) return corrupt(dir.string() + ": more than 2^20 entries");
    const std::string name = it->path().filename().string();
    // ZeRO's partitions, or MoE's files: zero_files' (which reads or refuses them)
    if (zero_optim_name(name) || zero_expert_name(name) || name.rfind("expp_rank_", 0) == 0)
      return std::optional<fs::path>{};
    if (zero_layer_name(name) ||
        (name.rfind("mp_rank_", 0) == 0 && name.ends_with("_model_states.pt") && name != "mp_rank_00_model_states.pt"))
      model_parallel.push_back(name);
  }
  if (ec) return io_error(fmt::format("{}: {}", dir.string(), ec.message()));
  const fs::path file = dir / "mp_rank_00_model_states.pt";
  if (!fs::is_regular_file(file, ec)) return std::optional<fs::path>{};
  if (!model_parallel.empty()) {
    std::sort(model_parallel.begin(), model_parallel.end());
    if (zero_layer_name(model_parallel.front()))  // "layer_*" sorts before "mp_rank_*"
      return unsupported(fmt::format("{}: a DeepSpeed pipeline without ZeRO in fp32 or fp16 (its layer files, {}, and "
                                     "each stage's optimizer inside its mp_rank_*_model_states.pt, its params numbered: "
                                     "which layers each stage holds is in no file): not read; under bf16 (its "
                                     "BF16_Optimizer's bf16_zero_pp_rank_* files) it is", dir.string(),
                                     model_parallel.front()));
    return corrupt(fmt::format("{}: a DeepSpeed checkpoint without ZeRO beside model-parallel ranks' files ({}): not "
                               "read (each rank's optimizer sits in its model states file, split by rules no file "
                               "holds)", dir.string(), model_parallel.front()));
  }
  return std::optional<fs::path>{file};
}

Result<std::optional<MoeStage0Files>> moe_stage0_files(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return std::optional<MoeStage0Files>{};
  MoeStage0Files out;
  out.dir = zero_tag_dir(path);
  std::map<int64_t, fs::path> optim;
  std::string other_mp;  // a file of a model-parallel rank other than 0, or a pipeline's layer file
  size_t seen = 0;
  for (fs::directory_iterator it(out.dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (++seen > (size_t{1} << 20)) return corrupt(out.dir.string() + ": more than 2^20 entries");
    const std::string name = it->path().filename().string();
    if (zero_optim_name(name)) return std::optional<MoeStage0Files>{};  // ZeRO's: zero_files reads them
    if (const auto e = zero_expert_name(name)) {
      if ((*e)[2] != 0) other_mp = name;
      out.experts[(*e)[0]][(*e)[1]] = it->path();
      continue;
    }
    constexpr std::string_view head = "expp_rank_", mid = "_mp_rank_", tail = "_optim_states.pt";
    if (name.rfind(head, 0) == 0 && name.ends_with(tail)) {
      const std::string body = name.substr(head.size(), name.size() - head.size() - tail.size());
      const auto m = body.find(mid);
      const auto e = m == std::string::npos ? std::nullopt : name_number(body.substr(0, m));
      const auto mp = m == std::string::npos ? std::nullopt : name_number(body.substr(m + mid.size()));
      if (!e || !mp) return corrupt(fmt::format("{}: {} is not expp_rank_<E>_mp_rank_<MM>_optim_states.pt", out.dir.string(), name));
      if (*mp != 0) other_mp = name;
      if (!optim.emplace(*e, it->path()).second)
        return corrupt(fmt::format("{}: two optimizer files of expert-parallel rank {}", out.dir.string(), *e));
      continue;
    }
    if (zero_layer_name(name) ||
        (name.rfind("mp_rank_", 0) == 0 && name.ends_with("_model_states.pt") && name != "mp_rank_00_model_states.pt"))
      other_mp = name;
  }
  if (ec) return io_error(fmt::format("{}: {}", out.dir.string(), ec.message()));
  if (optim.empty()) return std::optional<MoeStage0Files>{};
  if (!other_mp.empty())
    return corrupt(fmt::format("{}: {}: DeepSpeed MoE beside model parallelism (a pipeline's stages or tensor-parallel "
                               "ranks, whose experts split other ways): not read", out.dir.string(), other_mp));
  for (const auto& [e, file] : optim) {
    if (e != static_cast<int64_t>(out.optim.size()))
      return corrupt(fmt::format("{}: no expp_rank_{}_mp_rank_00_optim_states.pt (expert-parallel rank {}'s optimizer) "
                                 "beside expp_rank_{}'s", out.dir.string(), out.optim.size(), out.optim.size(), e));
    out.optim.push_back(file);
  }
  out.model = out.dir / "mp_rank_00_model_states.pt";
  if (!fs::is_regular_file(out.model, ec))
    return corrupt(fmt::format("{}: no mp_rank_00_model_states.pt (the dense params' weights and the MoE layers' "
                               "expert counts) beside the expp_rank_*_optim_states.pt files", out.dir.string()));
  return std::optional<MoeStage0Files>(std::move(out));
}

namespace {

Result<std::unique_ptr<CheckpointReader>> open_deepspeed_files(const fs::path& path) {
  if (const auto u = universal_dir(path)) {
    auto reader = std::make_unique<TorchSaveReader>(path);
    OPTSTATE_RETURN_IF_ERROR(reader->init_universal(u->first, u->second));
    return std::unique_ptr<CheckpointReader>(std::move(reader));
  }
  // Without ZeRO (stage 0): the optimizer in the model states file, which every data-parallel rank
  // holds whole (rank 0 saves it): read as that torch.save file.
  OPTSTATE_ASSIGN_OR_RETURN(const auto stage0, zero_stage0_file(path));
  if (stage0) return open_file(*stage0);
  OPTSTATE_ASSIGN_OR_RETURN(const auto moe0, moe_stage0_files(path));
  if (moe0) {
    auto reader = std::make_unique<TorchSaveReader>(path);
    OPTSTATE_RETURN_IF_ERROR(reader->init_moe_stage0(*moe0));
    return std::unique_ptr<CheckpointReader>(std::move(reader));
  }
  OPTSTATE_ASSIGN_OR_RETURN(const auto z, zero_files(path));
  if (!z) return invalid_argument(path.string() + ": no DeepSpeed ZeRO optimizer files (zero_pp_rank_*_optim_states.pt)");
  auto reader = std::make_unique<TorchSaveReader>(path);
  OPTSTATE_RETURN_IF_ERROR(reader->init_zero(*z));
  size_t rank_files = 0;  // each data-parallel rank's file of each model-parallel rank (stage)
  for (const ZeroStage& st : z->stages) rank_files += st.optim.size();
  reader->set_ranks(rank_files);
  return std::unique_ptr<CheckpointReader>(std::move(reader));
}

}  // namespace

Result<std::unique_ptr<CheckpointReader>> open_deepspeed(const fs::path& path) {
  OPTSTATE_ASSIGN_OR_RETURN(auto reader, open_deepspeed_files(path));
  // Read from the folder holding the tags: the note says which tag its `latest` (or
  // `latest_universal`) named, as DeepSpeed's load_checkpoint follows it.
  const auto universal = universal_dir(path);
  const fs::path tag = universal ? universal->first : zero_tag_dir(path);
  if (tag != path)
    reader->add_located_note(fmt::format("DeepSpeed's save folder: {} names {}/, the tag read",
                                         universal ? "latest_universal" : "latest", tag.filename().string()));
  return reader;
}

}  // namespace optstate::torchsave
