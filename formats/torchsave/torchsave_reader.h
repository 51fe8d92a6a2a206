// The torch.save driver's reader of one file, for formats whose files are torch.save's zip with a
// pickle it interprets: LibTorch's optimizer archives (formats/libtorch/), bitsandbytes' and torchao's
// state_dicts (formats/bitsandbytes/, formats/torchao/) open through it.
#pragma once

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "dcp/dcp_driver.h"
#include "optstate/checkpoint.h"
#include "torchsave_layout.h"

namespace optstate::torchsave {

Result<std::unique_ptr<CheckpointReader>> open_file(const std::filesystem::path& path);

// A per-rank file's name: <prefix><rank><ext> (verl's optim_world_size_8_rank_3.pt), ext .pt or .pth.
struct RankName {
  std::string prefix, ext;
  int64_t rank = 0;
};
std::optional<RankName> rank_name(const std::string& filename);

// FSDP's per-rank set as the reader read it (a directory of optimizer and model files, the model's
// of DTensors): what its writer for another world size needs (torchsave_ranks.h). FSDP2's optimizer
// files hold DTensors; FSDP1's (flat parameters, use_orig_params=False) plain 1-D parts of each
// FSDP unit's flat parameter, its params flattened and concatenated in `flat_units` order.
struct FsdpSet {
  std::filesystem::path dir;
  std::vector<std::filesystem::path> optim, model;  // by rank
  std::map<int64_t, std::string> fqn_of_id;         // FSDP2: rank 0's optimizer params (ParamSpec::id) -> name
  struct FlatParam {
    std::string fqn;
    int64_t numel = 0;
  };
  std::vector<std::vector<FlatParam>> flat_units;   // FSDP1: by optimizer param id (unit), its params in order
};
// The set `reader` reads, or null (another reader, one file, FSDP1 with use_orig_params, a set
// without model files or whose model files hold no DTensors).
const FsdpSet* fsdp_set(const CheckpointReader& reader);
// Whether `reader` reads one torch.save file whose optimizer sits beside other entries
// ({"model", "optimizer", "epoch"}, Lightning's .ckpt) and holds nothing else beyond the state: a
// torch.save write from it carries those entries into its own file.
bool carries_file(const CheckpointReader& reader);
// Of bitsandbytes' state read by `reader`: whether its tensors were nested in
// __bnb_optimizer_quant_state__ (bitsandbytes 0.49.2 and later) or beside 'step' (earlier
// releases); nullopt for another reader or state.
std::optional<bool> bnb_nested(const CheckpointReader& reader);

// A DeepSpeed ZeRO checkpoint (formats/deepspeed/): its tag folder (global_step500/, every rank's
// zero_pp_rank_R_mp_rank_00_optim_states.pt and the model states file), or the folder above whose
// `latest` file names the tag (Hugging Face's checkpoint-500/).
bool is_deepspeed_checkpoint(const std::filesystem::path& path);
Result<std::unique_ptr<CheckpointReader>> open_deepspeed(const std::filesystem::path& path);

// A training run's set of per-rank torch.save files, read as one state: nanotron's optimizer folder
// or Megatron-LM's legacy checkpoint (`megatron`, below). For nanotron (formats/nanotron/ finds the
// files and reads optimizer_config.json and, where needed, the model folder's shard metadata): a file per pipeline
// stage and tensor-parallel rank (and, under ZeRO-1, data-parallel rank), each torch.save of its
// NamedOptimizer's state_dict, params named by its 'names', their fp32 weights under
// 'gradient_accumulator' where it accumulates in fp32. A tensor-parallel rank's tensor of a param
// tensor parallelism shards is its local shard (`sharded`: where its elements lie in the whole);
// of any other param, tensor-parallel rank 0's is read. Under ZeRO-1 (`zero`) each file's tensors
// are 1-D runs [start, end) of its (local) tensors, flattened.
struct RankFileSet {
  std::filesystem::path path;  // what was opened: the checkpoint's folder or its optimizer/
  std::filesystem::path dir;   // the optimizer folder
  struct File {
    std::filesystem::path path;
    int64_t pp = 0, dp = 0, tp = 0;
    std::filesystem::path distrib;  // Megatron's distributed optimizer: the rank's distrib_optim.pt
    // Megatron's expert parallelism: the file's expert rank and its first expert (its local experts
    // numbered from 0); its dense params are expert rank 0's, not read from it
    int64_t ep = 0, expert_offset = 0;
    bool dense_elsewhere = false;  // ep > 0 in the whole set: its dense params read from expert rank 0's
  };
  std::vector<File> files;  // every (pp, tp, dp) once, in that order (Megatron's: (pp, ep, tp))
  int64_t dp_size = 1;
  struct Run {  // `count` elements from flat index `local` of a local shard to `global` of the whole
    int64_t local = 0, global = 0, count = 0;
  };
  struct Sharded {
    std::vector<int64_t> shape;  // the whole param's
    std::map<int64_t, std::pair<std::vector<int64_t>, std::vector<Run>>> by_tp;  // local shape, runs
  };
  std::map<std::string, Sharded> sharded;  // tp_size > 1: the params it shards, from model/
  std::set<std::string> replicated;        // tp_size > 1: the params model/ holds unsharded
  int64_t tp_size = 1;
  struct ZeroParam {
    std::map<int64_t, std::pair<int64_t, int64_t>> runs;  // dp rank -> [start, end) of the flat param
    std::vector<int64_t> shape;                           // its (local) shape
  };
  // ZeroDistributedOptimizer's, by param name: optimizer_config.json's (rank 0's stage); a param of
  // another stage is split by nanotron's rule over its shape in `shapes`.
  std::optional<std::map<std::string, ZeroParam>> zero;
  std::map<std::string, std::vector<int64_t>> shapes;  // model/'s (tensor-parallel rank 0's) shapes
  std::function<std::map<int64_t, std::pair<int64_t, int64_t>>(int64_t numel)> zero_rule;
  std::vector<std::string> not_read;
  // Megatron-LM's legacy checkpoint (formats/megatron/) read alike: a model_optim_rng.pt per
  // tensor-parallel rank (pp 0, dp 0), each the trainer's dict with the optimizer's state_dict and
  // the model's beside it, params named by their place among the model's tensors; `sharded` and
  // `replicated` from Megatron's layer names.
  bool megatron = false;
  int64_t megatron_ranks = 1;   // the checkpoint's tensor-parallel ranks (its args must say as many)
  int64_t megatron_stages = 1;  // ... and pipeline stages
  int64_t megatron_experts = 1; // ... and expert-parallel ranks
  bool megatron_chunked = false; // a virtual pipeline: names "model<c>.<name>", the prefix left out when renamed
  // Each stage's offset of its layers' numbers (a stage numbers its own from 0), per stack of
  // layers ("decoder.layers."): names are renumbered by megatron::renumber_layer before use.
  std::map<int64_t, std::map<std::string, int64_t>> layer_offsets;
  // (stage, name): a param another stage holds (the last stage's copy of a tied embedding), not read.
  std::set<std::pair<int64_t, std::string>> tied_copies;
};
Result<std::unique_ptr<CheckpointReader>> open_rank_files(const RankFileSet& parts);

// What a Megatron-LM model_optim_rng.pt's args say of the parallelism (each where they say it):
// formats/megatron/ tells a rank folder's one number after the tensor-parallel rank (a pipeline
// stage's or an expert rank's) by them.
struct MegatronSizes {
  std::optional<int64_t> tp, pp, ep, etp, num_experts;
};
Result<MegatronSizes> read_megatron_sizes(const std::filesystem::path& file);

// What a DeepSpeed universal checkpoint written from a ZeRO-1/2 checkpoint carries of it
// (formats/deepspeed/): the model states file, copied as it is, and zero/optimizer_state.pt's pickle,
// as ds_to_universal makes it: rank 0's optimizer_state_dict without its partitions
// (base_optimizer_state, param_slice_mappings, single_partition_of_fp32_groups), plus the base
// optimizer's param_groups. ZeRO-3 checkpoints are refused, naming the stage.
struct ZeroUniversalParts {
  std::filesystem::path tag_dir, model_states;
  // Every pipeline stage's model states file (mp_rank_SS_model_states.pt), model_states first;
  // ds_to_universal copies each (DeepSpeed reads a stage's from the universal checkpoint).
  std::vector<std::filesystem::path> stage_model_states;
  // Stage 0's rank 0's optimizer_state_dict, without its partitions (ds_to_universal's too).
  std::string optimizer_state_pkl;
  // The model states' 'module' tensors that no param group holds (frozen params, buffers, a tied
  // weight's second name), which ds_to_universal writes too, as zero/<name>/fp32.pt of
  // {"param": tensor.float()}: each one's name and shape, and its values as float32 (torch's
  // .float(): floats widened, integers rounded), read from the model states file, CRC-32 checked.
  struct ModuleTensor {
    std::string name;
    std::vector<int64_t> shape;
  };
  std::vector<ModuleTensor> module_only;
  std::function<Result<std::vector<float>>(size_t index)> module_values;
  // The wrapped optimizer keeps each param's step as a Python int (DeepSpeed's own CPU Adam, under
  // ZeRO-Offload), not a 0-d float32 tensor (torch's): ds_to_universal saves step.pt as it was.
  bool int_step = false;
  // Params AutoTP's affine map places (a tensor-parallel checkpoint's): ds_to_universal writes
  // their files as {"param": tensor}, without cat_dim.
  std::set<std::string> affine_params;
};
Result<ZeroUniversalParts> zero_universal_parts(const std::filesystem::path& path);

// The name of a file's first zip record, from its first local header (the sniffers' cheap look:
// torch.save writes <folder>/data.pkl first, LibTorch <folder>/data/0); nullopt for anything else.
std::optional<std::string> first_zip_record(const std::filesystem::path& path);

// Whose optimizer a torch.save file's state is, from its data.pkl (the first 8 MiB): bitsandbytes'
// (it names "state1" and "state2"), torchao's (its tensor subclasses, or param groups with a tensor
// lr and no 'maximize'), else torch's. The bitsandbytes and torchao drivers sniff their own; the
// torch.save driver's sniff leaves those to them.
enum class Family { kTorch, kBitsandbytes, kTorchao };
Family state_family(const std::filesystem::path& path);
// The sniff of the three: a torch.save file (first zip record <folder>/data.pkl) of `family`'s state.
bool is_torch_save_of(const std::filesystem::path& path, Family family);

// Writes a torch.save file at `path`: data.pkl, then the storages `storages` writes (torch's record
// order, 64-byte aligned, CRC-32s), staged beside `path`, fsync'd and renamed into place; on any
// error nothing is left. The torch.save, bitsandbytes and torchao writers.
Status write_file(const std::filesystem::path& path, bool overwrite, std::string_view pkl,
                  const std::function<Status(dcp::ArchiveWriter&)>& storages);

// The archive alone, created at `path` and fsync'd, no staging: for a file inside a staged folder
// (DeepSpeed's universal checkpoint), which is published whole. write_file stages around it.
Status write_archive(const std::filesystem::path& path, std::string_view pkl,
                     const std::function<Status(dcp::ArchiveWriter&)>& storages);

// write_file of a planned state_dict (the bitsandbytes and torchao writers): each storage as `plan`
// lists it, every entry loaded from `source` once (its components are written in turn), the
// model's other tensors streamed from `model_from` (StorageSpec::of_model_tensor).
Status write_plan(StateSource& source, const std::filesystem::path& path, bool overwrite, const Plan& plan,
                  const CheckpointReader* model_from = nullptr);

// A state written into the pickle of the file `from` reads (carries_file): the optimizer's dict
// replaced by `frame`'s (written optimizer_only, the source groups' other keys carried into its
// groups through group_extra), each param's tensor in the model's dict by the state's weights, and
// everything else carried as it is, storages byte for byte (formats/torchsave/FORMAT.md). The
// torch.save, bitsandbytes and torchao writers, from a training loop's own file.
Status write_carrying(StateSource& source, const CheckpointReader& from, const std::filesystem::path& path,
                      bool overwrite, const PlanFrame& frame);
// A planner's state_dict written at `path`: into the source's own file's layout where
// options.source is a training loop's file (write_carrying), else as a file of its own (write_plan).
Status write_framed(StateSource& source, const std::filesystem::path& path, const WriteOptions& options,
                    const PlanFrame& frame);
// The names a file write_framed writes of `kept` reads back with: a model dict of its own whose every
// key begins with 'module.' (the state's names kept that prefix: its source's model dict had other
// keys, which the file does not hold) reads as DDP's, the prefix dropped (FormatDriver::kept_by_write).
OptimizerState framed_read_back(OptimizerState kept, const WriteOptions& options);
// What convert says of it (FormatDriver::write_notes), if anything.
std::vector<std::string> framed_read_back_notes(const OptimizerState& kept, const WriteOptions& options);

}  // namespace optstate::torchsave
