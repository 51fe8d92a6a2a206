// The torch.save driver's archive access, shared with the DeepSpeed writer (formats/deepspeed/):
// an opened torch.save zip and its interpreted data.pkl, a storage record read whole, and a
// DeepSpeed ZeRO checkpoint's files. Internal to optstate_formats.
#pragma once

#include <fmt/format.h>

#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "dcp/dcp_driver.h"
#include "dcp/pickle.h"
#include "dcp/zip.h"
#include "optstate/io.h"
#include "optstate/status.h"

namespace optstate::torchsave {

// One torch.save archive: the file, its zip index and the folder its records sit in.
struct Archive {
  fs::path path;
  InputFile file;
  dcp::ArchiveIndex index;
  std::map<std::string, size_t> entries;  // record name -> index.entries
  std::string prefix;

  // The offset of a record's data: past its local header, which is checked against the directory.
  Result<uint64_t> data_at(const zip::Entry& e) const {
    std::byte h[30];
    if (e.local_header_offset > file.size() || file.size() - e.local_header_offset < sizeof h)
      return corrupt(fmt::format("{}: record '{}' starts past the end of the file", path.string(), e.name));
    OPTSTATE_RETURN_IF_ERROR(file.read_at(e.local_header_offset, h).with_context(path.string()));
    return zip::data_offset(h, e, index.cd.offset, path.string());
  }
};

// Opens a torch.save archive and interprets its data.pkl (CRC-checked).
Result<std::pair<Archive, pickle::Pickle>> open_archive(const fs::path& path);

// The bytes of storage `key` (the record <folder>/data/<key>), CRC-32 checked.
Result<std::vector<std::byte>> read_storage(const Archive& a, const std::string& key);

// A DeepSpeed ZeRO checkpoint's tag folder (global_step500/): each data-parallel rank's optimizer
// file, in rank order, and the model states file that names the params; under pipeline
// parallelism (DeepSpeed's PipelineModule) one such set per stage, its model-parallel rank
// (zero_pp_rank_R_mp_rank_SS_optim_states.pt, mp_rank_SS_model_states.pt).
struct ZeroStage {
  std::vector<fs::path> optim;
  fs::path model;
};
struct ZeroFiles {
  fs::path dir;
  std::vector<ZeroStage> stages;  // every stage's, in stage order (one without model parallelism)
  size_t layer_files = 0;         // layer_*-model_states.pt: a pipeline's module weights, per layer
  // Several model-parallel ranks and no layer files: tensor-parallel ranks (DeepSpeed's AutoTP),
  // each "stage" a rank's shards.
  bool tensor_parallel = false;
  // DeepSpeed MoE: each MoE layer's experts' weight files (layer_L_expert_E_mp_rank_00_model_states.pt,
  // E the expert's global number), by layer; and expp_rank_*_optim_states.pt, which hold no state
  // under ZeRO.
  std::map<int64_t, std::set<int64_t>> expert_files;
  size_t expert_optim_files = 0;
  // Stage 0's files (the only stage's without model parallelism).
  const std::vector<fs::path>& optim() const { return stages.front().optim; }
  const fs::path& model() const { return stages.front().model; }
};

// The ZeRO files of the tag folder at (or named by `latest` in) `path`; nullopt where it holds none.
Result<std::optional<ZeroFiles>> zero_files(const fs::path& path);
// DeepSpeed without ZeRO (stage 0): the tag folder's mp_rank_00_model_states.pt, which holds the
// optimizer (torch's state_dict, or its mixed-precision wrapper's: FP16_UnfusedOptimizer); nullopt
// where the folder holds ZeRO files (zero_files) or no model states; an error beside model-parallel
// ranks' files.
Result<std::optional<fs::path>> zero_stage0_file(const fs::path& path);

// DeepSpeed MoE without ZeRO (stage 0): each expert-parallel rank's whole optimizer (its dense
// params and its local experts, numbered) in expp_rank_E_mp_rank_00_optim_states.pt (E a rank of
// the largest expert-parallel group), the dense weights in mp_rank_00_model_states.pt's ['module'],
// each expert's in layer_L_expert_G_mp_rank_00_model_states.pt (G its global number). nullopt
// where the tag folder holds ZeRO files or no expp_rank_* files.
struct MoeStage0Files {
  fs::path dir, model;
  std::vector<fs::path> optim;                              // by expert-parallel rank
  std::map<int64_t, std::map<int64_t, fs::path>> experts;  // layer -> global expert -> file
};
Result<std::optional<MoeStage0Files>> moe_stage0_files(const fs::path& path);

}  // namespace optstate::torchsave
