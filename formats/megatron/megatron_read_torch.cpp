// The torch.save reader's part for Megatron-LM's legacy checkpoint (--ckpt-format torch): a rank's
// distrib_optim.pt, the distributed optimizer's flat buffers, read as the state_dict of a torch.save
// file whose params are views of them (TorchSaveReader::megatron_distributed_state). Layout: FORMAT.md.
#include "torchsave/torchsave_reader_impl.h"

namespace optstate::torchsave::detail {

auto TorchSaveReader::megatron_distributed_state(const RankFileSet::File& f) -> Result<StateDict> {
  const std::string mw = f.path.string(), dw = f.distrib.string();
  OPTSTATE_ASSIGN_OR_RETURN(auto model_ap, open_archive(f.path));
  OPTSTATE_ASSIGN_OR_RETURN(auto distrib_ap, open_archive(f.distrib));
  const pickle::Pickle& mp = model_ap.second;
  const pickle::Pickle& dp = distrib_ap.second;
  const Archive& model_archive = model_ap.first;
  StateDict sd;
  sd.megatron = true;
  sd.megatron_args = megatron_args_of(mp);
  sd.optimizer_path = "['optimizer']";
  const auto* root_items = mp.at(mp.root()).kind == pickle::Kind::kDict ? &mp.at(mp.root()).items : nullptr;
  if (!root_items) return corrupt(mw + ": data.pkl is not Megatron's trainer dict");
  for (size_t k = 0; k + 1 < root_items->size(); k += 2) {
    const auto key = dcp::as_string(mp, (*root_items)[k]);
    if (!key || (*key != "model" && *key != "optimizer")) sd.not_read.push_back(fmt::format("['{}']", key ? *key : "?"));
  }
  // The optimizer's groups (no members) and step; under a mixture of experts Megatron's chain of
  // optimizers, a list: the dense params' and the experts', each with its own groups and buffers.
  const pickle::Ref opt_ref = mp.dict_get(mp.root(), "optimizer");
  std::vector<pickle::Ref> opt_refs{opt_ref};
  if (opt_ref != pickle::kNoRef && mp.at(opt_ref).kind == pickle::Kind::kList)
    opt_refs.assign(mp.at(opt_ref).items.begin(), mp.at(opt_ref).items.end());
  const bool chain = opt_refs.size() != 1 || (opt_ref != pickle::kNoRef && mp.at(opt_ref).kind == pickle::Kind::kList);
  if (opt_refs.empty() || opt_refs.size() > 16)
    return corrupt(fmt::format("{} ['optimizer']: a chain of {} optimizers", mw, opt_refs.size()));
  struct Part {
    dcp::megatron::Optimizer opt;
    std::string where;
    bool experts = false;             // the experts' optimizer of the chain
    size_t decay = 0, no_decay = 0;   // its groups among sd.groups (sd.groups.size(): none)
  };
  std::vector<Part> opts;
  std::set<bool> kinds;
  for (size_t i = 0; i < opt_refs.size(); ++i) {
    Part part;
    part.where = chain ? fmt::format("{} ['optimizer'][{}]", mw, i) : mw + " ['optimizer']";
    OPTSTATE_ASSIGN_OR_RETURN(part.opt, dcp::megatron::interpret_legacy_optimizer(mp, opt_refs[i], part.where));
    if (!part.opt.group_step)
      return corrupt(part.where + ": the distributed optimizer's param groups hold no 'step'");
    const auto& groups = part.opt.groups;
    for (size_t g = 0; g < groups.size(); ++g)
      if (groups[g].expert_parallel != groups[0].expert_parallel)
        return corrupt(fmt::format("{}: param groups of the experts (is_expert_parallel) beside groups of dense "
                                   "params; Megatron's chain gives each its own optimizer", part.where));
    part.experts = !groups.empty() && groups[0].expert_parallel;
    if (part.experts && !chain)
      return corrupt(part.where + ": the experts' param groups (is_expert_parallel) alone, without the chain of "
                                  "the dense params' optimizer and the experts'");
    if (!kinds.insert(part.experts).second)
      return unsupported(fmt::format("{}: a second optimizer of {} in Megatron's chain; optstate reads a chain of the "
                                     "dense params' optimizer and the experts'", part.where,
                                     part.experts ? "experts' params" : "dense params"));
    const size_t none = std::numeric_limits<size_t>::max(), base = sd.groups.size();
    part.decay = part.no_decay = none;
    for (size_t g = 0; g < groups.size(); ++g) {
      const dcp::megatron::Group& mg = groups[g];
      for (const auto& [key, v] : mg.extras)
        if ((key == "is_decoupled_lr" && v.kind == GroupValue::Kind::kBool && v.i != 0) ||
            (key == "lr_mult" && ((v.kind == GroupValue::Kind::kFloat && v.f != 1) || (v.kind == GroupValue::Kind::kInt && v.i != 1))))
          return unsupported(fmt::format("{} param group {}: {} (a group of its own lr); Megatron keeps no group's "
                                         "members, and optstate places params by Megatron-Core's standard groups "
                                         "only (weight decay or none)", part.where, g, key));
      size_t& slot = mg.wd_mult == 0 ? part.no_decay : part.decay;
      if (slot != none)
        return unsupported(fmt::format("{}: param groups {} and {} are both {}; optstate places params by "
                                       "Megatron-Core's standard groups only (weight decay or none)", part.where,
                                       slot - base, g,
                                       mg.wd_mult == 0 ? "without weight decay" : "with weight decay"));
      slot = sd.groups.size();
      GroupSpec gs;
      gs.hyper = mg.hyper;
      gs.flags = mg.flags;
      gs.lr.number = mg.hyper.lr;
      gs.beta1.number = mg.hyper.beta1;
      gs.beta2.number = mg.hyper.beta2;
      for (const auto& [key, v] : mg.extras) gs.extras.push_back({key, v, std::nullopt});
      sd.groups.push_back(std::move(gs));
    }
    opts.push_back(std::move(part));
  }
  // the model, or under a virtual pipeline its chunks (the buffers of all of them, in chunk order)
  ModelSource models;
  if (const pickle::Ref model = mp.dict_get(mp.root(), "model"); model != pickle::kNoRef) {
    models.parts.push_back({model, "['model']", ""});
  } else {
    OPTSTATE_ASSIGN_OR_RETURN(const auto chunks, megatron_model_chunks(mp, mw));
    if (!chunks) return corrupt(mw + ": no ['model'], whose weights place the params in the buffers");
    models = *chunks;
    sd.megatron_chunks = models.parts.size();
    std::erase_if(sd.not_read, [&](const std::string& n) {
      return std::any_of(models.parts.begin(), models.parts.end(), [&](const auto& part) { return part.key == n; });
    });
  }
  OPTSTATE_ASSIGN_OR_RETURN(const ModelDict md, interpret_model_source(mp, models, mw));
  sd.model_ref = models.parts[0].dict;
  sd.model_key = models.key();

  // distrib_optim.pt: {"buckets_coalesced": True, <buffer>: {(param dtype, grad dtype): {"param",
  // "exp_avg", "exp_avg_sq": flat fp32, "numel_unpadded": int}}}
  const pickle::Ref dtop = dp.root();
  const bool listed = dp.at(dtop).kind == pickle::Kind::kList;
  std::vector<pickle::Ref> states{dtop};
  if (listed) states.assign(dp.at(dtop).items.begin(), dp.at(dtop).items.end());
  if (listed != chain || states.size() != opts.size())
    return corrupt(fmt::format("{}: {}; {} ['optimizer'] holds {}", dw,
                               listed ? fmt::format("a list of {} optimizers' states", states.size())
                                      : "one optimizer's state",
                               mw, chain ? fmt::format("a chain of {} optimizers", opts.size()) : "one optimizer"));
  files_.push_back(std::move(distrib_ap.first));
  const size_t fi = files_.size() - 1;
  std::vector<bool> taken(md.tensors.size(), false);
  int64_t id = 0;
  std::set<size_t> unplaced;  // model tensors of a buffer's dtype that no buffer holds
  for (size_t oi = 0; oi < opts.size(); ++oi) {
    const Part& part = opts[oi];
    const pickle::Ref droot = states[oi];
    const std::string sw = chain ? fmt::format("{} [{}]", dw, oi) : dw;
    if (dp.at(droot).kind == pickle::Kind::kNone) {
      // the dense params' state saved by data-parallel rank 0, in expert rank 0's folder
      if (part.experts || f.ep == 0)
        return corrupt(fmt::format("{}: None, where the {}' state belongs (each expert rank's folder holds its "
                                   "experts', expert rank 0's the dense params')", sw,
                                   part.experts ? "experts" : "dense params"));
      continue;
    }
    OPTSTATE_ASSIGN_OR_RETURN(const auto buffers, dcp::megatron::interpret_param_state(dp, droot, sw));
    for (const dcp::megatron::FlatBuffer& fb : buffers) {
      const std::string bw = fmt::format("{} [{}]", sw, fb.gbuf);
      const DType param_dtype = fb.param_dtype;
      const int64_t numel = fb.numel;
      std::map<std::string, dcp::TensorRef> flat;
      for (const auto& [e, t] : fb.entries) {
        OPTSTATE_RETURN_IF_ERROR(resolve(fi, t, numel, fmt::format("{} '{}'", bw, e)).status());
        flat.emplace(e, t);
      }
      // the model's tensors of the buffer's dtype, in module order (a param is in one buffer)
      std::vector<size_t> cand;
      std::vector<int64_t> numels;
      std::vector<std::string> names;
      for (size_t t = 0; t < md.tensors.size(); ++t) {
        const ModelTensor& mt = md.tensors[t];
        if (taken[t] || mt.tensor.dtype != param_dtype || mt.dtensor) continue;
        if (chain && megatron::is_expert_param(mt.name) != part.experts) continue;  // the chain's other optimizer's
        OPTSTATE_ASSIGN_OR_RETURN(const int64_t tn, checked_numel(mt.tensor.shape));
        cand.push_back(t);
        numels.push_back(tn);
        names.push_back(mt.name);
      }
      megatron::BufferValues values;
      values.buffer = [&](std::span<const int64_t> at) -> Result<std::vector<uint32_t>> {
        OPTSTATE_ASSIGN_OR_RETURN(auto bits, read_samples(files_[fi], fi, flat.at(kParam), numel, at, bw + " 'param'"));
        round_samples(bits, param_dtype);
        return bits;
      };
      values.tensor = [&](size_t c, std::span<const int64_t> at) -> Result<std::vector<uint32_t>> {
        const ModelTensor& mt = md.tensors[cand[c]];
        const auto chunk = models.parts.size() > 1 ? megatron::chunk_of(mt.name) : std::nullopt;
        return read_samples(model_archive, 0, mt.tensor, numels[c], at,
                            chunk ? fmt::format("{} ['model{}']['{}']", mw, chunk->chunk, chunk->rest)
                                  : fmt::format("{} ['model']['{}']", mw, mt.name));
      };
      OPTSTATE_ASSIGN_OR_RETURN(const auto placed, megatron::place_in_buffer(numel, numels, names, values, bw));
      for (size_t c = 0; c < cand.size(); ++c) {
        if (!placed[c]) {
          unplaced.insert(cand[c]);
          continue;
        }
        const ModelTensor& mt = md.tensors[cand[c]];
        taken[cand[c]] = true;
        unplaced.erase(cand[c]);
        ParamSpec spec;
        spec.fqn = mt.name;
        spec.id = id++;
        const bool no_wd = mt.name.ends_with(".bias") || mt.tensor.shape.size() == 1;
        const size_t g = no_wd ? part.no_decay : part.decay;
        if (g == std::numeric_limits<size_t>::max())
          return corrupt(fmt::format("{}: '{}' takes a param group {} weight decay by Megatron-Core's rule, and the "
                                     "optimizer has none", part.where, mt.name, no_wd ? "without" : "with"));
        spec.group = static_cast<int>(g);
        spec.shape = mt.tensor.shape;
        spec.step.number = *part.opt.group_step;
        auto view = [&](const char* e) {
          dcp::TensorRef t = flat.at(e);
          t.offset += *placed[c];
          t.shape = mt.tensor.shape;
          t.stride.clear();
          return t;
        };
        for (const char* e : {kExpAvg, kExpAvgSq}) {
          EntrySpec es;
          es.values = view(e);
          spec.entries.emplace(e, std::move(es));
        }
        spec.weight = view(kParam);
        sd.groups[g].params.push_back(spec.fqn);
        sd.model_weight_keys.insert(mt.name);
        sd.params.push_back(std::move(spec));
      }
    }
  }
  if (sd.params.empty()) return corrupt(dw + ": no buffer holds a param of the model's");
  std::sort(sd.params.begin(), sd.params.end(), [](const ParamSpec& a, const ParamSpec& b) { return a.id < b.id; });
  sd.members = sd.params.size();
  const size_t others = md.tensors.size() + md.others - sd.params.size();
  sd.model_others = others;
  if (others) {
    sd.model_others_line = sd.not_read.size();
    sd.not_read.push_back(model_others_text(sd.model_key, others));
  }
  if (const size_t frozen = unplaced.size())
    sd.not_read.push_back(fmt::format("{} model tensor{} in no buffer of the distributed optimizer (frozen params)",
                                      frozen, frozen == 1 ? "" : "s"));
  sd.read_notes.push_back("Megatron's distributed optimizer keeps no param's place: each param found in its DDP "
                          "buffer (distrib_optim.pt) where its fp32 main params round to the model's weights, read "
                          "as the weights");
  sd.read_notes.push_back("Megatron saves no param group's members; its standard groups take them by Megatron-Core's "
                          "rule (no weight decay for biases and 1-D params)");
  if (chain)
    sd.read_notes.push_back(fmt::format("Megatron's chain of {} optimizers (['optimizer']: the dense params' and the "
                                        "MoE experts', each with its own buffers) read as one state, their param "
                                        "groups one after another", opts.size()));
  return sd;
}

}  // namespace optstate::torchsave::detail
