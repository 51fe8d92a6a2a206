// The torch.save driver's reader (TorchSaveReader): one class whose parts are defined by the
// files of the layouts they read, beside their formats: torchsave_format.cpp (one file, the pieces,
// streaming, CRC checks), torchsave_read_ranks.cpp (per-rank sets: FSDP2, FSDP1, DDP ranks),
// deepspeed/deepspeed_read_zero.cpp (ZeRO 1-3, pipelines, AutoTP, MoE, AutoEP),
// deepspeed/deepspeed_read_stage0.cpp (without ZeRO: FP16_Optimizer's flat groups, MoE ranks),
// deepspeed/deepspeed_read_universal.cpp, megatron/megatron_read_torch.cpp (Megatron-LM's
// distrib_optim.pt). Internal to formats/: the drivers use torchsave_reader.h.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <deque>
#include <fstream>
#include <memory>
#include <numeric>
#include <set>

#include "dcp/bnb_state.h"
#include "dcp/chunks.h"
#include "dcp/dcp_driver.h"
#include "dcp/megatron.h"
#include "dcp/zip.h"
#include "deepspeed/deepspeed_flat.h"
#include "megatron/megatron_layout.h"
#include "optstate/checkpoint.h"
#include "optstate/io.h"
#include "torchsave_archive.h"
#include "torchsave_reader.h"
#include "torchsave_planner.h"
#include "torchsave_ranks.h"
#include "optstate/quant8.h"
#include "optstate/transform.h"
#include "registry.h"
#include "torchsave_layout.h"

namespace optstate::torchsave::detail {

// DeepSpeed's pipeline layer files (layer_XX-model_states.pt; with a tensor-parallel rank:
// layer_XX-model_YY-model_states.pt): -1, YY, or nullopt for another name.
std::optional<int64_t> zero_layer_name(const std::string& name);

// A whole tensor of archive `a` as float32, as torch's .float() gives it: floats widened (f64
// rounded), integers rounded to nearest. Read with its whole storage record, CRC-32 checked.
Result<std::vector<float>> tensor_f32(const Archive& a, const dcp::TensorRef& t, const std::string& where);

// Where a run of a tensor's bytes lies: its archive, offset and length, and its storage record with
// the CRC-32 torch.save stored for it. Reading the run checks that CRC where the run is all of its
// tensor and the rest of the record is no larger than the run (read too, for the check): torch's
// own tensors fill their records; FSDP2's sharded params are views into padded storages. A small
// view of a large storage, or one row-run of a column-sharded DTensor, is not checked.
struct Stored {
  size_t file = 0;
  uint64_t at = 0, bytes = 0;
  uint64_t record_at = 0, record_bytes = 0;
  uint32_t crc = 0;
  bool whole = false;  // the run is all of its tensor
  bool checked() const { return whole && crc != 0 && record_bytes - bytes <= bytes; }
  // A dense tensor stored permuted (channels_last, transposed): `at`/`bytes` are all of its
  // elements, in storage order; the run is its logical elements from `permuted_local` on.
  std::shared_ptr<const dcp::TensorRef> permuted;
  int64_t permuted_local = 0;
};

// 8-bit codes read as fp32 values: a rank's part that torchao quantized as its own tensor (blocks
// of that part) where the entry cannot be blockwise8 as a whole (other ranks' parts plain, or
// blocks that do not fall on the global tensor's).
struct Dequant {
  Stored scales;      // all of the part's scales
  int64_t local = 0;  // the run's first element within the part
  int64_t block = 0;
  const std::array<float, 256>* table = nullptr;  // the map's values, or float8_e4m3fn's (torchao's fp8)
  int bits = 8;                                   // 4: two codes a byte (torchao's 4-bit)
};

// A run of consecutive flat elements of a component (blocks, for absmax), stored consecutively;
// with `dq`, stored as 8-bit codes (`stored` is the run's codes) and read as fp32 values.
struct Piece {
  int64_t begin = 0, count = 0;
  Stored stored;
  std::optional<Dequant> dq;
};

// One rank's part of a tensor: its bytes in that rank's file and, for a DTensor, its placement;
// with `scales`, the part is 8-bit codes (`tensor`) read as fp32 values.
struct Part {
  Part(size_t file, dcp::TensorRef tensor, const std::optional<DTensorSpec>* dtensor,
       std::optional<dcp::TensorRef> scales = std::nullopt, int64_t block = 0,
       const std::array<float, 256>* table = nullptr, int bits = 8)
      : file(file), tensor(std::move(tensor)), dtensor(dtensor), scales(std::move(scales)), block(block), table(table),
        bits(bits) {}
  size_t file;
  dcp::TensorRef tensor;
  const std::optional<DTensorSpec>* dtensor;
  std::optional<dcp::TensorRef> scales;
  int64_t block;
  const std::array<float, 256>* table;  // with scales: how codes decode
  int bits;                             // with scales: 8, or 4 (two codes a byte)
};

// The pieces of a component, and the part each came from.
struct Placed {
  std::vector<Piece> pieces;
  std::vector<size_t> of;
};

// A directory of per-rank torch.save files, <prefix><rank>.pt (verl's
// optim_world_size_8_rank_3.pt, with model_world_size_8_rank_3.pt beside it): FSDP2's
// optimizer.state_dict() and model.state_dict() of DTensors, saved by every rank.
using Key = std::tuple<std::string, std::string, Component>;

inline bool numbered(const std::string& name, int64_t id) { return name == std::to_string(id); }

class TorchSaveReader final : public CheckpointReader {
 public:
  explicit TorchSaveReader(fs::path path) : path_(std::move(path)) {}

  // A LibTorch archive is read here (the same zip, pickle and tensors) for formats/libtorch/,
  // bitsandbytes' state_dict for formats/bitsandbytes/ and one file of torchao's for formats/torchao/.
  std::string_view format() const override;
  const fs::path& path() const override { return path_; }
  const OptimizerState& meta() const override { return meta_; }
  std::vector<std::string> not_read() const override {
    std::vector<std::string> out = not_read_;
    out.insert(out.end(), encoding_notes_.begin(), encoding_notes_.end());
    out.insert(out.end(), uncarried_notes_.begin(), uncarried_notes_.end());
    return out;
  }
  std::vector<std::string> carried_not_read() const override { return not_read_; }
  bool checksummed() const override { return checksummed_ || shared_verified_; }
  const FsdpSet* fsdp() const { return fsdp_ ? &*fsdp_ : nullptr; }
  bool carries_rest() const { return carries_rest_; }
  std::vector<std::string> read_notes() const override { return value_notes_; }
  std::string_view torchao_package() const override { return torchao_package_; }
  std::span<const AdamWFlags> adamw_flags() const override { return adamw_flags_; }
  std::span<const GroupExtras> group_extras() const override { return group_extras_; }
  std::span<const ModelTensorInfo> model_tensors() const override { return model_tensors_; }
  std::optional<bool> bnb_nested() const { return bnb_nested_; }
  // Per-rank files (FSDP's, DeepSpeed ZeRO's, Megatron's and nanotron's ranks): how many ranks' files.
  std::optional<int64_t> ranks() const override { return ranks_; }
  void set_ranks(size_t n) { ranks_ = static_cast<int64_t>(n); }

  // Read with buffers of its own (const: a writer holds its source as const), the record's CRC-32
  // checked as the state's runs are.
  Status stream_model_tensor(size_t index, const ByteSink& sink) const override;

  Status verify_shared_records() override;

  // Elements held twice (ZeroCopy: a pipeline's tied module in a later stage, a block several
  // tensor-parallel ranks hold): each copy's runs against the elements read there, window by window.
  Status compare_tied_copies();

  Status stream(const std::string& fqn, const std::string& entry, Component c, const ByteSink& sink) override;

  Status read_range(const std::string& fqn, const std::string& entry, Component c, int64_t begin, int64_t end,
                    std::span<std::byte> out) override;

  // Elements [begin, end) of the run `pieces` (in range) into `out`.
  Status read_pieces(const std::vector<Piece>& pieces, int64_t elem, const std::string& fqn, const std::string& entry,
                     Component c, int64_t begin, int64_t end, std::span<std::byte> out);

  std::string locate(const std::string& fqn, const std::string& entry, Component c, int64_t index) const override;

  // Elements [from, to) of a run of a tensor stored permuted, through `sink`: its storage record is
  // read whole (and checked against its CRC-32), its elements put in logical order once and kept
  // for the next run of it.
  Status permuted_run(const Stored& s, int64_t from, int64_t to, const std::string& fqn, const std::string& entry,
                      Component c, const ByteSink& sink);

  // Elements [from, to) of a dequantized piece as fp32 bytes, in bounded pieces. The part's
  // scales are read whole (a 256th of its codes) and checked; the codes' CRC-32 is checked where
  // the run is their whole record and read whole.
  Status dequantized(const Piece& pc, int64_t from, int64_t to, const std::string& fqn, const std::string& entry,
                     Component c, const ByteSink& sink);

  // One file, or a per-rank set (optimizer files in rank order; the model's beside them, if any).
  Status init(const std::vector<fs::path>& optim_files, const std::vector<fs::path>& model_files,
              std::vector<std::string> not_read);

  // The model dict's tensors beside the optimizer that are no param's weights, for model_tensors():
  // plain tensors whose storage resolves, each under torch's fqn of its key unless a param or
  // another tensor has that name. What is left stays counted on not_read's line for the dict.
  Status expose_model_tensors(const ModelDict& md, const StateDict& sd);

  // Two params of the files whose names are one fqn once the wrappers' segments are dropped
  // (torch_param_fqn) are not one state's: refused, naming both.
  Status one_name(const std::string& fqn, const std::string& source_fqn, const std::string& where) {
    const auto [it, added] = source_names_.emplace(fqn, source_fqn);
    if (added) return Status::Ok();
    return corrupt(fmt::format("{}: params '{}' and '{}' both have the name '{}' (torch.compile's, activation "
                               "checkpointing's and FSDP's segments dropped, as torch's state dicts drop them)",
                               where, it->second, source_fqn, fqn));
  }

  // The weights of `fqn` from the model's files (each rank's part, named `source_fqn` there), where
  // rank 0's has it.
  Result<bool> model_weights(const std::string& fqn, const std::string& source_fqn, ParamState& ps,
                             const std::vector<std::pair<ModelDict, size_t>>& models,
                             const std::vector<fs::path>& model_files);

  Status add_weights(const std::string& fqn, ParamState& ps, const std::vector<Part>& wparts, const std::string& ww);

  // What every kind of file ends with: what was not read, the structure check, whether every piece
  // is checksummed.
  Status finish(const std::vector<std::pair<ModelDict, size_t>>& models, const std::vector<fs::path>& model_files,
                size_t weights);

  // DeepSpeed ZeRO's tag folder (global_step500/): every data-parallel rank's optimizer file and
  // the model states file. Each param is put together from its runs in the ranks' flat partitions,
  // in rank order: stages 1 and 2 flatten each group's params in order and split the flat group in
  // equal parts (param_slice_mappings says where each rank's runs lie); stage 3 splits every param
  // in parts of ceil(numel / world), each rank's flat group their concatenation in order. Under
  // pipeline parallelism each stage is such a set of its own, with its own optimizer and groups:
  // read as one state, each stage's groups joined to the earlier stages' of the same settings.
  // Under AutoTP each tensor-parallel rank is such a set, holding its shards of every param:
  // put together where the model states' affine maps place them.
  Status init_zero(const ZeroFiles& z);

  // DeepSpeed MoE without ZeRO (init_moe_stage0): a tensor that may be a param (module order), one
  // expert-parallel rank's optimizer file, and where a kind of its groups' params were placed.
  struct MoeCand {
    std::string name;
    std::vector<int64_t> shape;
    dcp::TensorRef tensor;
    size_t file = 0;
    int64_t numel = 0;
  };
  struct MoeRank {
    StateDict sd;
    std::vector<int64_t> ep;  // by group: its expert-parallel size (0: dense)
    size_t file = 0;
    // FP16_Optimizer (each group one flat fp32 master, its optimizer one flat param a group): the
    // masters' lengths and each group's flat param in sd.params (none: never stepped)
    std::vector<int64_t> numel;
    std::vector<std::optional<size_t>> flat_of;
  };
  struct MoeSpot {   // a placed tensor: its group, and its id (numbered params) or where its
    size_t cand = 0, group = 0;  // elements start in the group's flat master (FP16_Optimizer)
    int64_t id = 0, begin = 0;
  };
  struct MoePlacement {
    std::vector<MoeSpot> placed;
    std::string why;  // why none fits (an error is one of reading)
  };

  // The model dict's tensors that may be params (fp32/bf16/fp16, no buffer), in its order.
  static Result<std::vector<MoeCand>> moe_candidates(const ModelDict& md, size_t file,
                                                     const std::set<std::string, std::less<>>& buffers);

  // One expert-parallel rank's optimizer file (`world` ranks): its state_dict, each group's
  // expert-parallel size, and under FP16_Optimizer its flat groups checked.
  Result<MoeRank> read_moe_rank(const fs::path& f, int64_t world);

  // Places one rank's groups of one kind (`ep`; 0: dense) among `cands`: numbered params by order
  // and shape (place_params_in_model), FP16_Optimizer's flat groups by value (place_in_flat_groups).
  Result<MoePlacement> place_moe_groups(const MoeRank& r, int64_t ep, const std::vector<const MoeCand*>& cands,
                                        const std::string& fw);

  // DeepSpeed MoE without ZeRO (stage 0; deepspeed/FORMAT.md): each expert-parallel rank's file
  // (expp_rank_E, E a rank of the largest expert-parallel group) holds its whole optimizer,
  // numbered: the dense params (alike on every rank) and its local experts, in groups of their own
  // ('moe', "ep_size_<size>"). Nothing names the numbers; each group's params are placed in order
  // and by shape (place_params_in_model, as names_from_model does for one model): a dense group's
  // among ['module']'s params, an MoE group's among the experts the rank holds of the layers of its
  // expert-parallel size, layer by layer and expert by expert in module order, named by their
  // layer_L_expert_G files (G the global number); under FP16_Optimizer (each group flat) by value
  // instead (place_moe_groups). Which size each MoE layer has is in no file: the one assignment
  // whose placements all fit is taken.
  Status init_moe_stage0(const MoeStage0Files& m);

  // Another copy of elements read elsewhere: a tied module's copy in a later pipeline stage
  // (DeepSpeed's TiedLayerSpec: the same name, stepped alike), or a tensor-parallel rank's copy
  // of a block every rank holds (AutoTP: a replicated param, stepped alike on each). `pieces` are
  // runs of the entry's elements in its order; validate compares them with what is read there.
  struct ZeroCopy {
    std::string fqn, entry;
    size_t stage = 0;
    std::vector<Piece> pieces;
  };

  // One model-parallel rank's ZeRO set (a pipeline stage, or a tensor-parallel rank) as read:
  // its groups (settings with the lr read; the step of each group's first flat param) and its
  // params in order, each entry's runs in the rank's own (local) element order.
  struct ZeroSliceParam {
    std::string name;
    std::vector<int64_t> shape;
    size_t group = 0;
    int64_t step = 0;
    std::map<std::string, std::vector<Piece>> entries;
  };
  struct ZeroSlice {
    std::vector<Hyperparameters> hyper;            // by param group
    std::vector<std::optional<int64_t>> step;      // by param group
    std::vector<ZeroSliceParam> params;
    ZeroShapes shapes;
  };

  // DeepSpeed MoE's experts as its ZeRO files hold them: each MoE group ('moe', "ep_size_E") lists
  // one expert-parallel rank's local experts, <prefix>deepspeed_moe.experts.deepspeed_experts.<i>.<rest>
  // with i < n; every expert-parallel rank e holds its own under the same names, and DeepSpeed
  // numbers them e*n+i (its layer_L_expert_<e*n+i> files). Each layer (prefix): its E and n (its
  // experts may sit in several groups: one per client group, all of one E),
  // checked against num_experts (n*E by layer) and the experts' files.
  struct ZeroExperts {
    struct Layer {
      std::string prefix;
      int64_t ep_size = 0, local_experts = 0;
    };
    std::vector<Layer> layers;  // by the groups' order
    std::map<std::string, std::pair<std::string, std::pair<int64_t, std::string>>> local;  // name -> prefix, (i, rest)
    int64_t experts = 0;                                                                     // all layers'
    // AutoEP's fused expert params: name -> the whole tensor's shape ([experts, ...]); each
    // expert-parallel rank e's shard is its experts e*n .. e*n+n-1, one block, as its map says.
    std::map<std::string, std::vector<int64_t>> autoep;
  };
  // An AutoEP param's map as DeepSpeed 0.19 writes it without folding (expert_tensor_parallel_size
  // 1): every expert-parallel rank e one piece, its whole shard (the param's shape in param_shapes),
  // at experts e*n.. of the whole; anything else (folded AutoEP+AutoTP) is refused.
  static Result<std::vector<int64_t>> autoep_whole_shape(const std::string& name, const std::vector<int64_t>& shard,
                                                         int64_t ep, const ZeroShapes::AutoEpLayer& layer,
                                                         const AffineMap& m, const std::string& mw);
  static Result<ZeroExperts> zero_experts(const ZeroFiles& z, const ZeroRank& r0, const ZeroShapes& shapes,
                                          const std::string& mw);

  // DeepSpeed orders the MoE groups by a set of their names (split_params_into_different_moe_groups_
  // for_optimizer), so ranks run with other hash seeds (torchrun's processes) save them in other
  // orders: `zr`'s MoE groups are put in rank 0's order. Each is rank 0's group of its expert-parallel
  // size and settings whose params (param_shapes, rank 0's) hold all of its runs; candidates are
  // taken by elimination, any still open (no runs to tell) in order. Dense groups keep their place.
  static Status align_moe_groups(ZeroRank& zr, const ZeroRank& r0, const ZeroShapes& shapes, const std::string& wf);

  // A pipeline's layer files (layer_<L>-model_states.pt in z.dir): layer -> key -> shape.
  using LayerShapes = std::map<int64_t, std::map<std::string, std::vector<int64_t>>>;
  static Result<LayerShapes> read_layer_shapes(const ZeroFiles& z);

  // DeepSpeed's pipeline under bf16 without ZeRO (BF16_Optimizer): the model states name no param's
  // shape (param_shapes None). Each flat param's params are its ranks' fragments (named; in flat
  // order: rank by rank, each from its start), their shapes the pipeline's layer files' tensors:
  // '<L>.<key>' is layer_<L>-model_states.pt's <key>; a tied module's 'tied_modules.<name>.<key>'
  // the <key> of the layer files that hold one of its element count (all of one shape).
  Status shapes_from_layer_files(const ZeroFiles& z, const std::vector<ZeroRank>& ranks, ZeroShapes& shapes,
                                 const std::string& mw, bool pipeline);

  Result<ZeroSlice> read_zero_slice(const ZeroFiles& z, size_t st);

  // A pipeline stage's slice joined to the state: stage 0's groups in order, whatever they hold; a
  // later stage's group joins the first of the same settings not taken by another of its groups
  // (on its first param that is not a tied copy), or is a group of its own.
  Status join_pipeline_stage(const ZeroFiles& z, size_t st, ZeroSlice slice, std::vector<int64_t>& group_steps,
                             std::map<std::string, size_t>& stage_of);

  // DeepSpeed's AutoTP: every tensor-parallel rank's slice holds every param (its shard), in the
  // same groups; each param's shards put together where rank 0's model states' affine map places
  // them (a block held by several ranks read from the first, the others' copies compared by
  // validate).
  Status join_tensor_parallel(const ZeroFiles& z, std::vector<ZeroSlice>& slices);

  // The contiguous runs of an affine piece: emit(first element in the whole tensor, first element
  // in the shard, count), each checked to lie in both. A piece's rows are runs where its innermost
  // strides are 1 on both sides, else single elements.
  template <typename Emit>
  static Status affine_runs(const AffinePiece& pc, int64_t numel, int64_t shard_numel, const std::string& where,
                            Emit&& emit);

  // Elements `at` of tensor `t` (of `count` elements) in archive `a` (file `file`), as bit patterns
  // (2 or 4 bytes, widened): the samples the placements by value compare.
  static Result<std::vector<uint32_t>> read_samples(const Archive& a, size_t file, const dcp::TensorRef& t, int64_t count,
                                                    std::span<const int64_t> at, const std::string& where);
  // fp32 bit patterns rounded to `to` (bf16, f16: round to nearest even; f32 kept), as the model's
  // weights are its fp32 main params rounded.
  static void round_samples(std::vector<uint32_t>& bits, DType to) {
    for (uint32_t& b : bits) {
      float v;
      std::memcpy(&v, &b, 4);
      b = to == DType::kBF16 ? f32_to_bf16(v) : to == DType::kF16 ? f32_to_f16(v) : b;
    }
  }

  // DeepSpeed's FP16_Optimizer (its fused form, without ZeRO) in the torch.save file `where`
  // (archive `fi`, pickle `p`): the inner optimizer's one flat param a group and the flat fp32
  // masters split into the model's params where deepspeed::place_in_flat_groups finds them; their
  // entries and weights become views of the flat tensors, numbered group by group as torch numbers
  // a group's params.
  // FP16_Optimizer's flat groups in the state_dict of archive `fi` (`where` names it): each group
  // one flat fp32 master (its length) and at most one flat param of that length with dense state
  // (its index in sd.params; none: the group never stepped).
  struct FlatGroups {
    std::vector<int64_t> numel;
    std::vector<std::optional<size_t>> flat_of;
  };
  Result<FlatGroups> flat_groups(const StateDict& sd, size_t fi, const std::string& where);

  Status place_deepspeed_flat(const pickle::Pickle& p, size_t fi, StateDict& sd, const std::string& where);

  // Megatron's distributed optimizer in its legacy checkpoint: `f.path` (model_optim_rng.pt) holds
  // the model's state_dict, which names the params, and the param groups (no members) with the
  // step; `f.distrib` (distrib_optim.pt, kept as this file's archive) each DDP buffer's main params
  // and moments, flat, each param where megatron::place_in_buffer finds it. Read as the StateDict
  // of a torch.save file: entries and weights are views of the buffers.
  Result<StateDict> megatron_distributed_state(const RankFileSet::File& f);

  // nanotron's optimizer files: each stage's params from its files, their groups the stage's (its
  // first file's; every data-parallel rank's file has the same groups, holding the params with a
  // run there), each param's runs put together where ZeRO-1 split it.
  Status init_rank_files(const RankFileSet& np);

  // A DeepSpeed universal checkpoint (`dir`: zero/optimizer_state.pt, zero/<param>/{fp32,exp_avg,
  // exp_avg_sq,step}.pt, the model states file `model`): groups and their params from the model
  // states' param_shapes, hyperparameters from optimizer_state.pt, each param's tensors whole.
  Status init_universal(const fs::path& dir, const fs::path& model);

  // "optim_world_size_2_rank_*.pt" for a per-rank set's files (their shared name, the rank as *).
  static std::string rank_pattern(const std::vector<fs::path>& files) {
    if (files.empty()) return "";
    const std::string name = files[0].filename().string();
    const auto rn = rank_name(name);
    return files.size() > 1 && rn ? rn->prefix + "*" + rn->ext : name;
  }

 private:
  // FSDP1's per-rank files (verl's FSDP strategy: FullyShardedDataParallel's optimizer.state_dict()
  // and, under SHARDED_STATE_DICT, model.state_dict() of DTensors): the optimizer steps plain 1-D
  // parts of flat parameters, which the model's DTensors (names in module order, shapes) place.
  // use_orig_params=True: one optimizer param per model param, each rank holding the run of it that
  // falls in its part of the unit's flat parameter (or none, and then no state), runs in rank
  // order; use_orig_params=False: one optimizer param per FSDP unit (match_flat_units), rank r
  // holding elements [r * shard, (r + 1) * shard) of it. Gives the number of params whose weights
  // came from the model's files.
  Result<size_t> init_fsdp1(const std::vector<StateDict>& sds, const std::vector<fs::path>& optim_files,
                            const std::vector<std::pair<ModelDict, size_t>>& models,
                            const std::vector<fs::path>& model_files);

  static const std::vector<int64_t>& global_shape(const ModelTensor& t) {
    return t.dtensor ? t.dtensor->global_shape : t.tensor.shape;
  }

  // One optimizer file beside one plain model file: FSDP1's flat parts (every moment 1-D, params
  // numbered) when the optimizer has fewer params than the model's tensors, or a moment of a param
  // that the model has with more than one dim.
  static bool flat_parts(const StateDict& sd, const ModelDict& md);

  // What the archives tell of model tensor `name`'s bytes without reading them: each rank's part's
  // storage record (CRC-32, size) where the part is that whole record; none where one is not.
  std::optional<std::vector<std::pair<uint32_t, uint64_t>>> record_signature(
      const std::vector<std::pair<ModelDict, size_t>>& models, const std::string& name) const;

  // Betas as files hold them: NaN where a tensor's value is still to be read (adamw_group), which
  // the read compares across the files then.
  // FSDP1's ranks: the same groups (hyperparameters, member count) in every file; which params
  // have state differs between ranks under use_orig_params.
  static Status same_groups(const StateDict& a, const StateDict& b, const std::string& wa, const std::string& wb);

  // Every rank's file must hold the same groups (members and hyperparameters) and the same params.
  static Status same_layout(const StateDict& a, const StateDict& b, const std::string& wa, const std::string& wb);

  // Numbered params named after the model's (names_from_model: the distinct DTensors of its
  // state_dict, each group's params among them in order; torch numbered the optimizer's params so
  // when it was given model.parameters() or filters of named_parameters()). Where they do not fit
  // one way, the params keep their numbers and the model files are named as not read.
  Status model_names(const StateDict& sd, const ModelDict& md, const fs::path& model0,
                     std::map<int64_t, std::string>& rename);

  // Places the ranks' parts of a component in the global tensor of `shape` as pieces: a plain
  // tensor (every rank holds all of it: rank 0's is read), or a DTensor on every rank, each part
  // where its mesh coordinate puts it (the mesh's shape is what the ranks' coordinates span), with
  // every element held by exactly one part.
  // `dense`: the parts are dense values (not 8-bit codes, whose blocks follow their storage order),
  // which may be stored permuted.
  Result<Placed> place(const std::vector<int64_t>& shape, const std::vector<Part>& parts, const std::string& where,
                       bool dense = false);

  // The scales of 8-bit codes placed as `codes`, where that gives blockwise8 state of the global
  // tensor: each part's codes one flat run that starts on a block boundary (torchao quantizes a
  // shard as its own tensor), its scales that run's blocks. Null where it does not.
  std::optional<std::vector<Piece>> absmax_pieces(const Placed& codes, const std::vector<Part>& scales, int64_t numel,
                                                  int64_t block);

  // Where a tensor's `count` elements lie in archive `file`: its storage record, checked to hold them.
  // `permuted_ok`: a dense tensor stored permuted is read (Stored::permuted); elsewhere refused.
  Result<Stored> resolve(size_t file, const dcp::TensorRef& t, int64_t count, const std::string& where,
                         bool permuted_ok = false) const {
    return resolve_in(files_[file], file, t, count, where, permuted_ok);
  }
  // The same in archive `a` (a file outside files_ too: `file` names it in the Stored).
  static Result<Stored> resolve_in(const Archive& a, size_t file, const dcp::TensorRef& t, int64_t count,
                                   const std::string& where, bool permuted_ok = false);

  // The CRC-32 of the record's bytes before the run (a view's offset into its storage), to start
  // the run's check with; 0 where the run is not checked.
  Result<uint32_t> record_prefix_crc(const Stored& s, const std::string& fqn, const std::string& entry, Component c) {
    if (!s.checked() || s.at == s.record_at) return 0u;
    return record_crc(s.file, s.record_at, s.at, 0, fqn, entry, c);
  }

  // CRC-32 `crc` continued over the file's bytes [from, to).
  Result<uint32_t> record_crc(size_t file, uint64_t from, uint64_t to, uint32_t crc, const std::string& fqn,
                              const std::string& entry, Component c);

  // Finishes a run's check: `crc` covers the record up to the run's end; the rest of the record
  // (a view's padding) is read into it, and the whole must be what torch.save stored.
  Status check_crc(const Stored& s, uint32_t crc, const std::string& fqn, const std::string& entry, Component c);

  std::string where_of(const Stored& s, const std::string& fqn, const std::string& entry, Component c) const {
    return fmt::format("{}: {}", files_[s.file].path.string(), name_of(fqn, entry, c));
  }

  Result<double> value_of(size_t file, const Scalar& s, const std::string& where) const;

  // torchao's 4-bit map (16 fp32 values) as a table the dequantizer indexes by code.
  Result<const std::array<float, 256>*> map16(size_t file, const dcp::TensorRef& q, const std::string& where);

  Result<std::string> map_name(size_t file, const dcp::TensorRef& q, const std::string& where) const;

  std::string name_of(const std::string& fqn, const std::string& entry, Component c) const {
    auto p = meta_.params.find(fqn);
    const bool eight = p != meta_.params.end() && p->second.entries.count(entry) &&
                       p->second.entries.at(entry).encoding == Encoding::kBlockwise8;
    return fmt::format("tensor '{}'{}", entry_key(fqn, entry), eight ? fmt::format(" ({})", component_name(c)) : "");
  }

  Result<const std::vector<Piece>*> find(const std::string& fqn, const std::string& entry, Component c) const {
    auto it = stored_.find({fqn, entry, c});
    if (it == stored_.end()) return not_found(fmt::format("{}: no {}", path_.string(), name_of(fqn, entry, c)));
    return &it->second;
  }

  fs::path path_;
  bool set_ = false;       // a per-rank set (a directory), not one file
  bool carries_rest_ = false;  // one file whose other entries a torch.save write from it carries
  std::vector<std::string> value_notes_;  // read_notes(): values read as other than they stand (Composer's decay)
  // A bf16 pipeline without ZeRO: its layer files' shapes (shapes_from_layer_files), read once.
  std::optional<LayerShapes> layer_shapes_;
  std::optional<FsdpSet> fsdp_;  // FSDP2 (or FSDP1, flat parameters) set with the model's files: what a writer of it needs
  bool libtorch_ = false;  // a LibTorch optimizer archive
  bool bnb_ = false;       // bitsandbytes' state: formats/bitsandbytes/ writes it
  bool torchao_ = false;   // one file of torchao's state: formats/torchao/ writes it
  std::string_view torchao_package_;  // where its torchao subclasses were defined (a kTorchaoOptimPackages view)
  std::vector<GroupExtras> group_extras_;  // each group's other keys, where the file keeps some
  std::vector<AdamWFlags> adamw_flags_;  // each group's AdamW switches, where the file keeps some
  std::optional<int64_t> ranks_;      // set_ranks
  std::optional<bool> bnb_nested_;    // bitsandbytes' state: nested in __bnb_optimizer_quant_state__ or not
  bool deepspeed_ = false; // a DeepSpeed ZeRO checkpoint: formats/deepspeed/ sniffs it
  std::vector<ZeroCopy> zero_copies_;  // a pipeline's tied modules' later copies, AutoTP's replicas
  bool tensor_parallel_ = false;         // zero_copies_ holds tensor-parallel ranks' copies
  bool nanotron_ = false;  // a nanotron checkpoint's optimizer files: formats/nanotron/ sniffs them
  bool megatron_ = false;  // a Megatron-LM legacy checkpoint's rank files: formats/megatron/ sniffs them
  bool shared_verified_ = false;  // verify_shared_records covered every record the pieces read
  std::vector<Archive> files_;
  OptimizerState meta_;
  std::vector<std::string> not_read_;
  std::vector<std::string> encoding_notes_;  // encodings read as fp32 values: in not_read(), not carried
  std::vector<std::string> uncarried_notes_;  // files beside that a carrying write leaves (a pipeline's layer files)
  std::map<Key, std::vector<Piece>> stored_;
  std::map<std::string, std::string> source_names_;  // a param's fqn -> its name in the files (one_name)
  std::vector<ModelTensorInfo> model_tensors_;        // expose_model_tensors
  std::vector<std::pair<Stored, std::string>> model_stored_;  // each one's bytes, and its key for messages
  std::vector<std::string> dequantized_;      // 8-bit entries read as fp32 values
  std::vector<std::string> dequantized_fp8_;  // torchao's fp8 entries, read as fp32 values
  std::vector<std::string> dequantized_4bit_;  // torchao's 4-bit entries, read as fp32 values
  std::deque<std::array<float, 256>> tables_;  // torchao's 4-bit maps (16 values), where parts point
  bool checksummed_ = false;
  ReadBuffer piece_;  // reused between tensors
  struct {
    const dcp::TensorRef* ref = nullptr;  // its Stored::permuted
    std::vector<std::byte> bytes;         // in logical order
  } permuted_;                            // the last tensor stored permuted that was read
  ReadBuffer pad_;    // a view's storage around it, read for its record's CRC-32
};

}  // namespace optstate::torchsave::detail
