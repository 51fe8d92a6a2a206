// A torch.save'd optimizer state_dict (`torch.save(optimizer.state_dict(), "optimizer.pt")`, as
// Hugging Face's Trainer and plain PyTorch loops keep it), interpreted from its data.pkl without
// running it, and encoded for the writer. Pure functions over the pickle; the driver
// (torchsave_format.cpp) reads the archive and the tensors' bytes. Layout and mapping: FORMAT.md.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "dcp/dcp_layout.h"
#include "dcp/pickle.h"
#include "optstate/state.h"
#include "optstate/torch_names.h"  // torch_param_fqn, place_params_in_model

namespace optstate::torchsave {

// A number the file holds either as a Python number or as a one-element tensor (torch keeps `step`
// as a float32 tensor; torchao keeps `lr` as one), which the driver reads.
struct Scalar {
  std::optional<double> number;
  std::optional<dcp::TensorRef> tensor;
};

// One mesh dim's placement of a DTensor (torch.distributed.tensor.placement_types).
struct Placement {
  enum class Kind { kShard, kReplicate } kind = Kind::kReplicate;
  int dim = 0;  // kShard: the tensor dim split across this mesh dim
  bool operator==(const Placement&) const = default;
};

// What a DTensor's pickle says of how its local tensor (one rank's) sits in the global tensor:
// FSDP2's optimizer.state_dict() and model.state_dict() hold DTensors, saved per rank (verl's
// optim_world_size_N_rank_R.pt).
struct DTensorSpec {
  std::vector<int64_t> global_shape;
  std::vector<Placement> placements;  // one per mesh dim
  std::vector<int64_t> coordinate;    // this rank's coordinate on each mesh dim
};

// Where a rank's local tensor lies in the global tensor, on a mesh of `mesh_shape`: each Shard
// placement splits the tensor dim as torch.chunk does (pieces of ceil(size / n), trailing ones
// short or empty), mesh dims in order. `replica`: the rank's coordinate on a Replicate dim is not
// 0, so another rank holds the same box.
struct Box {
  std::vector<int64_t> offsets, sizes;
  bool replica = false;
};
Result<Box> dtensor_box(const DTensorSpec& spec, const std::vector<int64_t>& mesh_shape, const std::string& where);

// FSDP1 (FullyShardedDataParallel, use_orig_params=False) steps flat parameters: one per FSDP
// unit, the params the unit wraps and no nested unit does, flattened and concatenated in module
// order, padded to a multiple of the world size; each rank's optimizer state holds its
// ceil(numel / world) elements. The files name no param of a unit: which params each unit holds
// is found from the model's params (names in module order, sizes) and each unit's per-rank length
// `shard` (units in the optimizer's order): the root's unit holds the params of no other unit (it
// comes first, and may be absent: everything wrapped), every other unit all params under one
// module, units in module order. Exactly one such split must fit, else an error saying why.
struct FlatUnits {
  std::vector<int> unit_of;       // per param: its unit
  std::vector<int64_t> offset;    // per param: where it starts in its unit's flat parameter
  std::vector<int64_t> numel;     // per unit: its params' elements (the rest of world * shard is padding)
};
Result<FlatUnits> match_flat_units(const std::vector<std::string>& names, const std::vector<int64_t>& numels,
                                   const std::vector<int64_t>& shard, int64_t world, const std::string& where);

struct EntrySpec {
  Encoding encoding = Encoding::kDense;
  dcp::TensorRef values;                // dense
  dcp::TensorRef codes, absmax;         // blockwise8
  int64_t block_size = 0;               // blockwise8
  std::optional<dcp::TensorRef> qmap;   // torchao's OptimState8bit: its map, checked by the driver
  std::optional<DType> apparent_dtype;  // torchao's subclasses: the dtype they claim, the param's
  bool fp8 = false;                     // torchao's OptimStateFp8: float8_e4m3fn codes, read dequantized
  int bits = 8;                         // 4: torchao's OptimState4bit (two codes a byte), read dequantized
  std::string qmap_name;                // optstate's plain 8-bit tensors: the map the group names
  std::optional<DTensorSpec> dtensor;   // a DTensor's local part: the tensors above are this rank's
  pickle::Ref ref = pickle::kNoRef;     // the pickled value (a DTensor: its _rebuild_from_type_v2 object)
};

struct ParamSpec {
  std::string fqn;
  int64_t id = 0;  // its index in the state_dict (torch numbers params 0.. across the groups)
  int group = 0;
  std::vector<int64_t> shape;
  Scalar step;
  std::map<std::string, EntrySpec> entries;
  std::optional<dcp::TensorRef> weight;  // from a "model" dict beside the optimizer's
  std::optional<DTensorSpec> weight_dtensor;
};

// A group's extra key (CheckpointReader::group_extras); a kTensor value's element is read by the
// driver from `tensor`.
struct GroupExtraSpec {
  std::string key;
  GroupValue value;
  std::optional<dcp::TensorRef> tensor;
};

struct GroupSpec {
  Hyperparameters hyper;
  AdamWFlags flags;  // torch.optim.AdamW's switches the group holds (CheckpointReader::adamw_flags)
  std::vector<GroupExtraSpec> extras;  // its other keys, in order
  Scalar lr;
  Scalar beta1, beta2;  // numbers, or (adamw_group's tensor_betas) one-element tensors to read
  std::vector<std::string> params;  // fqns, in the group's order (params without state left out)
};

// A count a LibTorch optimizer archive stores as a tensor ("param_groups/size", "params/size"),
// which the driver reads and checks against the entries the archive lists.
struct DeclaredCount {
  Scalar value;
  int64_t listed = 0;
  std::string where;
};

struct StateDict {
  std::vector<GroupSpec> groups;
  std::vector<ParamSpec> params;     // in id order
  size_t members = 0;                // params the groups list (with state or not): ids 0 .. members-1
  size_t stateless = 0;              // of those, params without state (never stepped: no shape in the file)
  std::vector<std::vector<int64_t>> member_ids;  // each group's param ids in its order, with state or not
  bool eight = false;                // any 8-bit entry, or a group with optstate's block_size
  std::string optimizer_path;        // where the optimizer's dict is: "" (the file is one) or "['optimizer']"
  pickle::Ref optimizer_ref = pickle::kNoRef;  // the optimizer's dict
  pickle::Ref model_ref = pickle::kNoRef;      // the model's state_dict beside it, if any
  std::string model_key;                       // where it is: "['model']", "['state_dict']"
  std::set<std::string> model_weight_keys;     // its keys read as the params' weights
  bool ddp_prefix = false;                     // its keys are a DDP model's (is_ddp_state_dict): names drop `module.`
  size_t model_others = 0;                     // its other entries, named in not_read ...
  std::optional<size_t> model_others_line;     // ... on this line of it, where there are any
  std::vector<std::string> not_read; // what the file holds that the canonical state does not
  std::vector<DeclaredCount> counts; // LibTorch archives: sizes to check against what is listed
  bool libtorch = false;             // a LibTorch optimizer archive (torch::save(optimizer, path))
  bool per_param = false;            // an optimizer per param, keyed by fqn (torchtune's optimizer in
                                     // backward): each group is one of them, holding its one param
  bool bnb = false;                  // bitsandbytes' state (state1/state2: dcp/bnb_state.h)
  std::optional<bool> bnb_nested;    // bitsandbytes': its tensors nested in kBnbQuantState (0.49.2 and
                                     // later) or beside 'step' (earlier), as the first param's were
  // Composer's (MosaicML's) DecoupledAdamW, whose weight decay is not scaled by lr: each group's
  // weight_decay read as AdamW's equivalent, divided by its initial_lr (kept in extras). A write
  // carrying the file would have to scale it back: such a file is not carried.
  bool decoupled_decay = false;
  // nanotron's optimizer (NamedOptimizer, OptimizerFromGradientAccumulator): its params named by the
  // optimizer dict's 'names', its fp32 weights in its 'gradient_accumulator' (read as the model dict,
  // model_key naming it). A write carrying the file would drop both with the optimizer dict it
  // replaces: such a file is not carried.
  bool nanotron = false;
  // Megatron's mixed-precision optimizer in its legacy checkpoint (model_optim_rng.pt): the
  // optimizer's dict at ['optimizer']['optimizer'], its fp32 main params (fp32_from_fp16_params)
  // read as the weights, the model dict's bf16/fp16 copies only naming the params. A write carrying
  // the file would leave the main params as they were: such a file is not carried.
  bool megatron = false;
  // DeepSpeed's mixed-precision optimizer without ZeRO (FP16_UnfusedOptimizer in
  // mp_rank_00_model_states.pt): its fp32 master params (['optimizer']['fp32_groups']) read as the
  // weights, as Megatron's; a write carrying the file would leave them as they were: not carried.
  bool deepspeed_fp16 = false;
  // ... its fused form (FP16_Optimizer): one flat fp32 master per group (['optimizer']
  // ['fp32_groups_flat'], `deepspeed_flat_at` naming the wrapper dict), the inner optimizer's params
  // (one per group) flat too; the params are placed in them by the format, from the model's
  // weights (deepspeed/deepspeed_flat.h), and the state split into views.
  bool deepspeed_flat = false;
  std::vector<dcp::TensorRef> deepspeed_flat_masters;
  std::string deepspeed_flat_at;
  // Megatron's trainer dict (['args'] beside ['checkpoint_version']): what its args (an
  // argparse.Namespace) say of the parallelism, where they say it.
  struct MegatronArgs {
    std::optional<int64_t> tp_size, pp_size, ep_size;
    std::optional<int64_t> etp_size;     // expert_tensor_parallel_size (None: tp_size)
    std::optional<int64_t> num_experts;  // a mixture of experts' experts a layer
    std::optional<int64_t> vp_size;      // virtual_pipeline_model_parallel_size: model chunks a stage
    std::optional<bool> distributed_optimizer;
  };
  std::optional<MegatronArgs> megatron_args;
  size_t megatron_chunks = 0;  // the trainer dict's model chunks (model0, model1, ...), if any
  std::vector<std::string> read_notes;  // CheckpointReader::read_notes
  bool torchao = false;              // torchao's state: OptimState8bit/Fp8/4bit moments, or groups with
                                     // lr a tensor and no 'maximize' (_AdamBase's: torchao's AdamW*)
  std::string_view torchao_package;   // where its subclasses were defined (dcp::kTorchaoOptimPackages);
                                     // the first seen
};

// The optimizer state_dict at the pickle's root, or the one dict beside others in a dict at the
// root ({"model": ..., "optimizer": ...}), or the one element of a list there (Lightning's
// "optimizer_states"); or LibTorch's optimizer archive, what C++'s torch::save(optimizer, path)
// writes for torch::optim::AdamW (and optstate's FusedAdamW and AdamW8bit): a TorchScript module
// whose attributes are the state (FORMAT.md). `where` names the file in errors.
Result<StateDict> interpret_state_dict(const pickle::Pickle& p, const std::string& where);
// Megatron-LM's trainer dict at the pickle's root (['args'], an argparse.Namespace, beside
// ['checkpoint_version']): what its args say of the parallelism; nullopt for another pickle.
std::optional<StateDict::MegatronArgs> megatron_args_of(const pickle::Pickle& p);
// not_read's line for the model dict's `others` entries beside the params' weights.
std::string model_others_text(std::string_view model_key, size_t others);


// A model's state_dict saved alone (FSDP2's model.state_dict() per rank, beside the optimizer's
// files): its tensors in order, by name. Entries that are no tensor are counted.
struct ModelTensor {
  std::string name;
  dcp::TensorRef tensor;
  std::optional<DTensorSpec> dtensor;
  pickle::Ref ref = pickle::kNoRef;  // the pickled object: tied weights are one object under two names
};
struct ModelDict {
  std::vector<ModelTensor> tensors;
  std::map<std::string, size_t, std::less<>> by_name;  // -> tensors
  size_t others = 0;
  const ModelTensor* find(std::string_view name) const {
    auto it = by_name.find(name);
    return it == by_name.end() ? nullptr : &tensors[it->second];
  }
};

// The model's state_dict(s) beside an optimizer: one dict, or under Megatron's virtual pipeline its
// model chunks' (the trainer dict's ['model0'], ['model1'], ...: each chunk numbers its layers from
// 0), whose entries are named "model<i>.<name>" here (megatron::chunk_of), so that the chunks' names
// stay apart and their tensors in order (the optimizer's params are chunk 0's, then chunk 1's, ...).
struct ModelSource {
  struct Part {
    pickle::Ref dict = pickle::kNoRef;
    std::string key;     // where it is: "['model']", "['model1']"
    std::string prefix;  // its entries' names' prefix: "", "model1."
  };
  std::vector<Part> parts;
  bool empty() const { return parts.empty(); }
  std::string key() const;  // "['model']", "['model0'], ['model1']"
};
// Megatron's trainer dict's model chunks (['model0'], ['model1'], ... in order, without ['model']),
// or nullopt where it has none; corrupt where they are not 0..N-1 dicts.
Result<std::optional<ModelSource>> megatron_model_chunks(const pickle::Pickle& p, const std::string& where);
// The source's dicts as one model dict, each entry named with its part's prefix.
Result<ModelDict> interpret_model_source(const pickle::Pickle& p, const ModelSource& models, const std::string& where);
Result<ModelDict> interpret_model_dict(const pickle::Pickle& p, const std::string& where);
// The same of the dict at `dict` (DeepSpeed's model states keep it under 'module').
Result<ModelDict> interpret_model_dict(const pickle::Pickle& p, pickle::Ref dict, const std::string& where);

// Names for numbered params (`member_ids`: each group's ids in order; `shape_of`: the shape of
// each id with state) from a model's state_dict: its params are its DTensors where it has any
// (FSDP's: buffers stay plain tensors), else its float tensors but torch.nn's norm buffers
// (running_mean, running_var, num_batches_tracked); tied weights (one object or storage under two
// names) once, under the first name, as named_parameters() gives them. Each group's params are
// placed among them in order (place_params_in_model). Either a name per id, or why there are none.
struct ModelNames {
  std::map<int64_t, std::string> by_id;
  std::string why;  // empty when named
};
ModelNames names_from_model(const ModelDict& md, const std::vector<std::vector<int64_t>>& member_ids,
                            const std::map<int64_t, std::vector<int64_t>>& shape_of);
// The model dict's tensors that may be an optimizer's params, in order (indices into md.tensors):
// float tensors (only its DTensors, where it holds any), no BatchNorm buffer, a tied weight (one
// object, or one storage view, under two names) once.
std::vector<size_t> param_candidates(const ModelDict& md);


// The frame every optimizer state_dict torch.save keeps shares, params numbered in the groups' order
// (param_order): {"state": {id: {<param_state>}}, "param_groups": [{"param_names" (unless every
// name is its number), "lr", "betas", "eps", "weight_decay", <group_fields>, "params"}]}, inside
// {"model": {fqn: <weight>}, "optimizer": ...} when the state has weights. The parts write their
// values into `w`: `weight` a param's weight tensor, `param_state` the key/value pairs of a
// stepped param's state, `group_fields` the optimizer's own group fields as key/value pairs, and
// `lr`, where set, group `group`'s lr value (torchao keeps a tensor; else a Python float).
// `optimizer_only`: the optimizer's dict alone, without the {"model", "optimizer"} around it (the
// writer that carries a file's other entries places it); `group_extra`, where set, writes more
// key/value pairs of group `group` (what the source's group held beyond AdamW's fields).
// `model_tensors`: the model's other tensors (the source's CheckpointReader::model_tensors), written
// into the model dict after the weights by `model_tensor` (either makes the model dict).
struct FrameParts {
  std::function<void(size_t id, const ParamState&)> weight, param_state;
  std::function<void(size_t group, const Hyperparameters&)> group_fields;
  std::function<void(size_t group, const Hyperparameters&)> lr;
  bool optimizer_only = false;
  std::function<void(size_t group)> group_extra;
  std::span<const ModelTensorInfo> model_tensors;
  std::function<void(size_t index, const ModelTensorInfo&)> model_tensor;
  // {fqn: state_dict} of an optimizer per param (StateDict::per_param), each group one param's
  // optimizer, numbered from 0 in it; with optimizer_only (the writer that carries such a file).
  // A group without params is a param the source's optimizer never stepped (no shape, so not in
  // the state): `stateless_optimizer` writes its key and the source's optimizer as they were.
  bool per_param = false;
  std::function<void(size_t group)> stateless_optimizer;
};
void encode_state_dict_frame(const OptimizerState& state, pickle::Writer& w, const FrameParts& parts);
// torch.optim.AdamW's group fields beyond lr, betas, eps and weight_decay (torch 2.13): amsgrad,
// maximize, foreach, capturable, differentiable, fused, decoupled_weight_decay (the switches: the
// `kept` ones where given, else torch's defaults).
void adamw_group_fields(pickle::Writer& w, const Hyperparameters& h, const AdamWFlags* kept = nullptr);

// A dict's or OrderedDict's items (k0, v0, k1, v1, ...), a list's or tuple's; null for anything else.
const pickle::Refs* dict_items(const pickle::Pickle& p, pickle::Ref r);
const pickle::Refs* list_items(const pickle::Pickle& p, pickle::Ref r);

// ---- DeepSpeed ZeRO (stages 1, 2 and 3), read for formats/deepspeed/ ----
// One rank's optimizer file (global_stepN/zero_pp_rank_R_mp_rank_00_optim_states.pt, "bf16_"
// before it under bf16): the wrapped torch optimizer's state of one flat fp32 param per group, this
// rank's partition of it, and that partition of the fp32 master weights.
struct ZeroFragment {
  std::string name;
  int64_t start = 0, numel = 0;  // where the param's run lies in this rank's partition
};
// One flat param: a param group's under ZeRO-1/2; under ZeRO-3 one of its sub-groups (DeepSpeed
// splits a group into flat params of at most sub_group_size elements, 1e9 by default), which the
// wrapped optimizer steps as its own params, numbered in group order.
// bitsandbytes' 8-bit state of a flat partition (its AdamW8bit wrapped by ZeRO): the codes are
// the moment's tensor; one absmax per block of the partition (blocks begin at the partition's
// start, not at a param's), and the map.
struct ZeroQuant {
  dcp::TensorRef absmax, qmap;
  int64_t block = 0;
};
struct ZeroGroup {
  size_t param_group = 0;                         // the param group it belongs to
  GroupSpec group;                                // hyperparameters (params: from the model states file)
  Scalar step;
  std::map<std::string, dcp::TensorRef> moments;  // exp_avg, exp_avg_sq (max_exp_avg_sq): 1-D partitions
  std::map<std::string, ZeroQuant> quant;         // moments kept as bitsandbytes' 8-bit codes (uint8)
  dcp::TensorRef master;                          // the fp32 weights' partition, 1-D
  std::vector<ZeroFragment> fragments;            // stages 1 and 2: param_slice_mappings, this rank's runs
  // A mixture of experts' group (DeepSpeed MoE: 'moe' true, named "ep_size_E"): its params are the
  // experts local to this rank's expert-parallel rank, split over its expert-data-parallel group
  // (partition_count: the world over E). nullopt: a dense group, split over the whole world.
  std::optional<int64_t> ep_size;
  int64_t partitions = 0;  // this group's partition_count
};
struct ZeroRank {
  int stage = 0;            // 1 or 2 (one layout), 3
  int64_t partitions = 0;   // partition_count: the data-parallel world size (the dense groups')
  size_t param_groups = 0;
  std::vector<ZeroGroup> groups;  // the flat params, in order (param_shapes lists one dict each)
  std::vector<std::string> not_read;
  bool bnb = false;  // the wrapped optimizer is bitsandbytes' (state1/state2, 8-bit or 32-bit)
};
Result<ZeroRank> interpret_zero_optim(const pickle::Pickle& p, const std::string& where);

// DeepSpeed's AutoTP (its tensor-parallel training, 0.19+) records in each model states file how
// every param's tensor-parallel shards lie in the whole tensor: universal_checkpoint_info's
// affine_map (version 1), per param a list of pieces per rank. A piece is a block of `shape` that is
// torch.as_strided(whole, shape, source_strides, source_offset) in the whole tensor and
// as_strided(shard, shape, dest_strides, dest_offset) in the rank's shard, held by every rank of
// `locations`, the shard holding it times `scale`.
struct AffinePiece {
  std::vector<int64_t> shape, source_strides, dest_strides;
  int64_t source_offset = 0, dest_offset = 0;
  std::vector<int64_t> locations;
  double scale = 1.0;
};
struct AffineRank {
  std::vector<int64_t> shard_shape;
  std::vector<AffinePiece> pieces;
};
struct AffineMap {
  std::vector<int64_t> logical_shape;
  std::map<int64_t, AffineRank> ranks;
};
struct AutoTpMaps {
  std::map<std::string, AffineMap> params;       // by param name
  std::map<std::string, std::string> unsupported;  // param name -> why DeepSpeed could not describe it
};
// The maps of universal_checkpoint_info (`info`), keyed by the param each pattern names: DeepSpeed
// writes a pattern as ^<re.escape(name)>$, which is unescaped; any other is refused. Caps: 2^16
// params, 4096 pieces a rank, 16 axes.
Result<AutoTpMaps> interpret_autotp_maps(const pickle::Pickle& p, pickle::Ref info, const std::string& where);
// The name a pattern ^<re.escape(name)>$ matches; nullopt for any other pattern.
std::optional<std::string> exact_name_of_pattern(std::string_view pattern);

// A DeepSpeed MoE param group's expert-parallel size from its name ("ep_size_<E>", as
// split_params_into_different_moe_groups_for_optimizer names it); nullopt for another name.
std::optional<int64_t> moe_group_ep_size(std::string_view name);

// The model states file (mp_rank_00_model_states.pt; stage 3: zero_pp_rank_0_mp_rank_00_model_states.pt):
// each group's params in flattening order with their shapes, and what else it holds.
struct ZeroShapes {
  std::vector<std::vector<std::pair<std::string, std::vector<int64_t>>>> groups;
  // param_shapes None beside an optimizer state dict: DeepSpeed without ZeRO whose optimizer saves
  // bf16_zero_pp_rank_* files all the same (a pipeline's BF16_Optimizer); `groups` empty.
  bool without_zero = false;
  std::vector<std::string> not_read;
  // ds_config's optimizer is "Adam" with adam_w_mode false: DeepSpeed's FusedAdam / CPUAdam in Adam's
  // L2 mode, which they keep outside their param groups (the readers refuse it with weight decay).
  bool l2_decay = false;
  // The grid DeepSpeed saved it on: checkpoint_parallel_dimensions (0.15+), mp_world_size (pp x tp).
  std::optional<int64_t> pp_degree, tp_degree, mp_world_size;
  // AutoTP's maps of the params' shards (universal_checkpoint_info.affine_map); `uc_info`: the file
  // holds a universal_checkpoint_info at all (Megatron-DeepSpeed's patterns without maps, too).
  std::optional<AutoTpMaps> autotp;
  bool uc_info = false;
  // DeepSpeed MoE: each MoE layer's expert count, in module order ('num_experts'; [] without MoE),
  // whether AutoEP's layers are recorded (ds_autoep_layers), and how expert parallelism laid out
  // the ranks (ds_config's use_data_before_expert_parallelism: an expert-parallel group is ranks
  // W/E apart, not consecutive).
  std::vector<int64_t> num_experts;
  bool data_before_expert = false;
  // AutoEP's MoE layers (ds_autoep_layers, DeepSpeed 0.19+): each layer's experts module holds fused
  // w1, w2, w3 of its expert-parallel rank's experts, [local experts, ...]; their maps (by param
  // name, the ranks being expert-parallel ranks) place each rank's in the whole [experts, ...].
  struct AutoEpLayer {
    std::string prefix;  // expert_key_prefix: <module>.experts
    int64_t num_experts = 0, num_local_experts = 0, ep_size = 0;
  };
  std::vector<AutoEpLayer> autoep_layers;
  AutoTpMaps autoep_maps;
};
// The model states' ds_config names the optimizer DeepSpeed built (none: the client's own, whose
// param groups tell); any but Adam or AdamW is refused, naming it.
Result<ZeroShapes> interpret_zero_model(const pickle::Pickle& p, const std::string& where);
// Refuses `shapes` of an L2-mode Adam run when any group (weight_decay, by group) decays.
Status check_zero_decay(const ZeroShapes& shapes, const std::vector<double>& weight_decay, const std::string& where);

// A DeepSpeed universal checkpoint (ds_to_universal's, or optstate's): zero/optimizer_state.pt's
// param_groups (AdamW's fields; the groups' params come from the model states file), and a
// per-param file: torch.save({"cat_dim": ..., "param": tensor}) or of the tensor alone (step.pt).
// ZeRO-3's has no step.pt per param: each group's step is its flat param's, in the nested
// optimizer_state_dict's state (`steps`, by group; absent where the file has none).
struct UniversalOptimizer {
  std::vector<GroupSpec> groups;
  std::map<size_t, Scalar> steps;  // by flat param (ZeRO-3's sub-group)
  // ZeRO-3's: each flat param's group, from the nested optimizer_state_dict's param_groups (its
  // 'params' list the flat params, numbered in group order); empty: one flat param per group.
  std::vector<size_t> group_of_flat;
};
Result<UniversalOptimizer> interpret_universal_optimizer(const pickle::Pickle& p, const std::string& where);
Result<dcp::TensorRef> interpret_universal_tensor(const pickle::Pickle& p, const std::string& where);
// A per-param step.pt: ds_to_universal saves the optimizer's step as it was, a 0-d tensor (torch's
// optimizers) or a Python int (DeepSpeed's own CPU Adam, ZeRO-Offload); {"param": step} taken too.
Result<Scalar> interpret_universal_step(const pickle::Pickle& p, const std::string& where);

// A planned state_dict of an optimizer with its own state layout (the bitsandbytes and torchao
// writers): data.pkl and its storage records "0", "1", ... in writing order, each one of:
struct StorageSpec {
  enum class What {
    kComponent,  // a component of an entry (fqn, entry, component), as stored
    kF32Values,  // entry (fqn, entry) as fp32 values: dense widened, 8-bit dequantized
    kQMap,       // the 256 floats of map `qmap`
    kScalar,     // a float32 0-d tensor holding `scalar` (torchao's step and lr)
    kModelTensor,  // the source's model tensor `index` (CheckpointReader::stream_model_tensor)
  } what = What::kComponent;
  std::string fqn, entry;
  Component component = Component::kValues;
  std::string qmap;
  float scalar = 0;
  size_t index = 0;

  static StorageSpec of_component(const std::string& fqn, const std::string& entry, Component c = Component::kValues);
  static StorageSpec of_f32_values(const std::string& fqn, const std::string& entry);
  static StorageSpec of_qmap(const std::string& name);
  static StorageSpec of_scalar(float v);
  static StorageSpec of_model_tensor(size_t index);
};
struct Plan {
  std::string data_pkl;
  std::vector<StorageSpec> storages;  // storage keys "0", "1", ... in this order
};

// How a planner writes its optimizer state_dict frame into a pickle that may be another's (the
// writer that carries a training loop's file): `add` takes a new storage and gives its key;
// `optimizer_only` and `group_extra` as in FrameParts.
using SpecSink = std::function<std::string(StorageSpec)>;
struct FrameOptions {
  bool optimizer_only = false;
  std::function<void(size_t group)> group_extra;
  // The source's AdamW switches by group (CheckpointReader::adamw_flags), for torch.optim.AdamW's
  // frame to keep; used where there is one per group.
  std::span<const AdamWFlags> adamw_flags;
  // The source's other group keys by group (CheckpointReader::group_extras), written by value
  // before what group_extra carries; used where there is one per group.
  std::span<const GroupExtras> group_extras;
  // The source's model tensors (CheckpointReader::model_tensors), for the frame's model dict.
  std::span<const ModelTensorInfo> model_tensors;
  // FrameParts::per_param and stateless_optimizer: the source's optimizers were one per param
  // (write_carrying).
  bool per_param = false;
  std::function<void(size_t group)> stateless_optimizer;
};
// FrameParts::group_extra for a planner's frame: group g's keys of options.group_extras (a
// one-element tensor as a float32 tensor where `tensor_lr`, the frame writing lr as a tensor,
// else as a float, as the frame's lr), then what options.group_extra carries.
std::function<void(size_t group)> group_extras_writer(pickle::Writer& w, const SpecSink& add,
                                                      const FrameOptions& options, size_t groups, bool tensor_lr);
// FrameParts::model_tensor for a planner's frame: the tensor, its bytes the source's, streamed as
// the file is written (StorageSpec::of_model_tensor).
std::function<void(size_t index, const ModelTensorInfo&)> model_tensor_writer(pickle::Writer& w, const SpecSink& add);
// A planner's frame: its checks (an error before anything is written), then its pickle into `w`.
using PlanFrame = std::function<Status(pickle::Writer& w, const SpecSink& add, const FrameOptions& options)>;
// The whole file's plan of a frame: data.pkl and its storages "0", "1", ...
Result<Plan> plan_of(const PlanFrame& frame, const FrameOptions& options = {});
// torch.optim.AdamW's state_dict frame, params numbered in the groups' order: every entry as torch
// keeps it (8-bit moments as fp32 values, each step a float32 tensor). With weights, the file is
// {"model": {fqn: weight}, "optimizer": state_dict}. `param_names` are written unless every name is
// its own number (what this reader gives files without them), so a file read without names writes
// back as it was.
Status plan_adamw_frame(const OptimizerState& state, pickle::Writer& w, const SpecSink& add,
                        const FrameOptions& options);

// The params in the order torch numbers them (the groups' order): what plan_adamw_frame's ids mean.
std::vector<std::string> param_order(const OptimizerState& state);

}  // namespace optstate::torchsave
