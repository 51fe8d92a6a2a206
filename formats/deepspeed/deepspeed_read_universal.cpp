// The torch.save reader's part for DeepSpeed's universal checkpoint (ds_to_universal's zero/
// folder: a file per param and state; TorchSaveReader::init_universal). Layout: FORMAT.md.
#include "torchsave/torchsave_reader_impl.h"

namespace optstate::torchsave::detail {

auto TorchSaveReader::init_universal(const fs::path& dir, const fs::path& model) -> Status {
  deepspeed_ = true;
  const fs::path opt_file = dir / "zero" / "optimizer_state.pt";
  OPTSTATE_ASSIGN_OR_RETURN(auto opt, open_archive(opt_file));
  OPTSTATE_ASSIGN_OR_RETURN(const UniversalOptimizer uo, interpret_universal_optimizer(opt.second, opt_file.string()));
  const std::vector<GroupSpec>& groups = uo.groups;
  files_.push_back(std::move(opt.first));
  const size_t opt_index = files_.size() - 1;
  OPTSTATE_ASSIGN_OR_RETURN(auto ms, open_archive(model));
  OPTSTATE_ASSIGN_OR_RETURN(const ZeroShapes shapes, interpret_zero_model(ms.second, model.string()));
  // param_shapes lists each flat param's params: one per group, or ZeRO-3's sub-groups.
  const size_t flats = uo.group_of_flat.empty() ? groups.size() : uo.group_of_flat.size();
  if (shapes.groups.size() != flats)
    return corrupt(fmt::format("{}: {} flat params in param_shapes, {} in {}", model.string(), shapes.groups.size(),
                               flats, opt_file.string()));
  std::vector<double> decay;
  for (const GroupSpec& g : groups) decay.push_back(g.hyper.weight_decay);
  OPTSTATE_RETURN_IF_ERROR(check_zero_decay(shapes, decay, model.string()));
  not_read_ = shapes.not_read;
  // A pipeline's stages (ds_to_universal copies each stage's mp_rank_SS_model_states.pt): their
  // params, in stage order, in the groups of stage 0's settings (optimizer_state.pt holds stage
  // 0's; DeepSpeed gives each stage's group g those).
  std::error_code ec;
  std::vector<ZeroShapes> stage_shapes;
  std::vector<fs::path> stage_models{model};
  stage_shapes.push_back(shapes);
  // Under tensor parallelism (AutoTP) the files are its ranks': rank 0's names every param, and
  // its affine map their whole shapes (its param_shapes are its shards').
  const bool tensor_parallel = shapes.tp_degree.value_or(1) > 1;
  if (tensor_parallel && !shapes.autotp)
    return corrupt(fmt::format("{}: tp_degree {} and no affine_map: the params' whole shapes are in no file",
                               model.string(), *shapes.tp_degree));
  for (int s = 1; !tensor_parallel && model.filename() == "mp_rank_00_model_states.pt" && s < (1 << 16); ++s) {
    const fs::path next = dir / fmt::format("mp_rank_{:02d}_model_states.pt", s);
    if (!fs::is_regular_file(next, ec)) break;
    OPTSTATE_ASSIGN_OR_RETURN(auto ns, open_archive(next));
    OPTSTATE_ASSIGN_OR_RETURN(ZeroShapes more, interpret_zero_model(ns.second, next.string()));
    if (more.groups.size() != flats)
      return corrupt(fmt::format("{}: {} param groups in param_shapes, {} in {}", next.string(), more.groups.size(),
                                 flats, opt_file.string()));
    if (more.tp_degree && *more.tp_degree != 1)
      return corrupt(fmt::format("{}: tp_degree {}: tensor-parallel checkpoints are not read (a pipeline's stages "
                                 "are)", next.string(), *more.tp_degree));
    OPTSTATE_RETURN_IF_ERROR(check_zero_decay(more, decay, next.string()));
    for (const std::string& n : more.not_read)
      if (std::find(not_read_.begin(), not_read_.end(), n) == not_read_.end()) not_read_.push_back(n);
    stage_shapes.push_back(std::move(more));
    stage_models.push_back(next);
  }
  std::map<std::string, size_t> stage_of;
  std::map<std::string, std::set<size_t>> tied;
  meta_.kind = "adamw";
  for (const GroupSpec& spec : groups) {
    ParamGroup group;
    group.hyper = spec.hyper;
    group.hyper.lr = *spec.lr.number;
    meta_.groups.push_back(group);
  }
  for (size_t stage = 0; stage < stage_shapes.size(); ++stage)
  for (size_t flat = 0; flat < flats; ++flat) {
    const size_t g = uo.group_of_flat.empty() ? flat : uo.group_of_flat[flat];
    const ParamGroup& group = meta_.groups[g];
    const std::string mw = stage_models[stage].string();
    for (auto [name, shape] : stage_shapes[stage].groups[flat]) {
      if (tensor_parallel) {
        const auto m = shapes.autotp->params.find(name);
        if (m == shapes.autotp->params.end())
          return corrupt(fmt::format("{}: '{}' has no affine map (its whole shape)", mw, name));
        shape = m->second.logical_shape;
      } else if (const auto e = stage_shapes[stage].autoep_maps.params.find(name);
                 e != stage_shapes[stage].autoep_maps.params.end()) {
        // AutoEP's fused experts: param_shapes holds rank 0's [local experts, ...]; its map the whole
        const auto& whole = e->second.logical_shape;
        if (whole.size() != shape.size() || shape.empty() || !std::equal(shape.begin() + 1, shape.end(), whole.begin() + 1))
          return corrupt(fmt::format("{}: AutoEP's '{}' of shape [{}], whole [{}] in its map", mw, name,
                                     fmt::join(shape, ", "), fmt::join(whole, ", ")));
        shape = whole;
      }
      const fs::path pdir = dir / "zero" / name;
      const std::string pw = fmt::format("{} '{}'", (dir / "zero").string(), name);
      if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..")
        return corrupt(fmt::format("{}: param name '{}' is no folder name", mw, name));
      if (const auto earlier = meta_.params.find(name); earlier != meta_.params.end()) {
        // a tied module's copy in a later stage: one param of the universal checkpoint
        if (stage_of.at(name) == stage || earlier->second.shape != shape || earlier->second.group != static_cast<int>(g))
          return corrupt(fmt::format("{}: param '{}' is listed twice", mw, name));
        tied[name].insert(stage);
        continue;
      }
      stage_of[name] = stage;
      OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(shape));
      ParamState ps;
      ps.shape = shape;
      ps.group = static_cast<int>(g);
      std::vector<std::pair<std::string, std::string>> files = {{kParam, "fp32.pt"}};
      const bool moments = fs::is_regular_file(pdir / "exp_avg.pt", ec) || fs::is_regular_file(pdir / "exp_avg_sq.pt", ec);
      if (moments) {
        files.insert(files.end(), {{kExpAvg, "exp_avg.pt"}, {kExpAvgSq, "exp_avg_sq.pt"}});
        if (group.hyper.amsgrad) files.emplace_back(kMaxExpAvgSq, "max_exp_avg_sq.pt");
      }
      for (const auto& [entry, file] : files) {
        const fs::path f = pdir / file;
        if (!fs::is_regular_file(f, ec)) return corrupt(fmt::format("{}: no {}", pw, file));
        OPTSTATE_ASSIGN_OR_RETURN(auto a, open_archive(f));
        OPTSTATE_ASSIGN_OR_RETURN(const dcp::TensorRef t, interpret_universal_tensor(a.second, f.string()));
        files_.push_back(std::move(a.first));
        OPTSTATE_ASSIGN_OR_RETURN(const Stored whole, resolve(files_.size() - 1, t, numel, f.string()));
        stored_[{name, entry, Component::kValues}] = {Piece{0, numel, whole, std::nullopt}};
        ps.entries.emplace(entry, Entry{});  // fp32 values
      }
      if (moments) {
        const fs::path f = pdir / "step.pt";
        double st = 0;
        if (fs::is_regular_file(f, ec)) {
          OPTSTATE_ASSIGN_OR_RETURN(auto a, open_archive(f));
          OPTSTATE_ASSIGN_OR_RETURN(const Scalar step, interpret_universal_step(a.second, f.string()));
          files_.push_back(std::move(a.first));
          OPTSTATE_ASSIGN_OR_RETURN(st, value_of(files_.size() - 1, step, f.string()));
        } else if (const auto gs = uo.steps.find(flat); gs != uo.steps.end()) {  // ZeRO-3's: its flat param's
          OPTSTATE_ASSIGN_OR_RETURN(st, value_of(opt_index, gs->second,
                                                 fmt::format("{} flat param {} step", opt_file.string(), flat)));
        } else {
          return corrupt(pw + ": no step.pt, and " + opt_file.string() + " holds no step for its group");
        }
        if (!(st >= 0 && st < 9.2e18) || st != std::floor(st)) return corrupt(fmt::format("{}: step {} is not a count", pw, st));
        ps.step = static_cast<int64_t>(st);
      }
      meta_.groups[g].params.push_back(name);
      meta_.params.emplace(name, std::move(ps));
    }
  }
  for (const auto& [name, stages] : tied)
    value_notes_.push_back(fmt::format("'{}' is in the param_shapes of pipeline stages {} and {} (a tied module): "
                                       "one param", name, stage_of.at(name), fmt::join(stages, ", ")));
  return finish({}, {}, 0);
}

}  // namespace optstate::torchsave::detail
