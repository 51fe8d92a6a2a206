// DCP's Hugging Face storage (torch.distributed.checkpoint's HuggingFaceStorageWriter; NeMo
// Automodel's backport of it writes `model/` under `model_save_format: safetensors`): no
// `.metadata`. Each rank writes its piece of every tensor into safetensors files of its own (NeMo
// Automodel: `shard-<rank + 1>-model-<i>-of-<n>.safetensors`), whose
// `__metadata__["DCP_SHARDING_INFO"]` is a JSON object `{fqn: {"saved_offsets": [...]}}` placing
// each piece in the whole tensor; a file without it holds whole tensors, as torch's reader takes
// it. The whole tensor's shape is not stored: it is where the pieces end. Layout and what is
// refused: FORMAT.md, "Hugging Face storage".
//
// Parsing is pure (add_file over a parsed header); read_hf_storage_folder is the edge that lists
// the folder and reads the headers, giving the DCP reader a Metadata whose chunks are raw storage.
#pragma once

#include <cstddef>
#include <filesystem>
#include <string>

#include "dcp_layout.h"
#include "optstate/status.h"
#include "safetensors/safetensors_layout.h"

namespace optstate::dcp::hf_storage {

inline constexpr const char* kShardingInfoKey = "DCP_SHARDING_INFO";
inline constexpr size_t kMaxFiles = size_t{1} << 16;
inline constexpr size_t kMaxShardingInfoBytes = size_t{64} << 20;

// The pieces a file's header holds, added to `md`: each tensor a chunk of item <name> at its
// saved_offsets (zeros without sharding info), stored raw at the file's data start + its begin.
// Refuses, naming the file and tensor: sharding info that is not JSON, a tensor it does not place
// or places with other axes or a negative offset, a piece whose end overflows, a tensor whose
// pieces disagree on dtype or axes, a piece placed twice at the same offsets.
Status add_file(const safetensors::Header& h, const std::string& relative_path, Metadata& md, const std::string& where);

// Each item's size: where its pieces end, axis by axis (their coverage of it, no holes and no
// overlaps, is checked when an item is read, as for any DCP).
void finish(Metadata& md);

// A folder without `.metadata` holding safetensors files (only listed: a damaged one is named by
// read_hf_storage_folder, not passed over).
bool is_hf_storage_folder(const std::filesystem::path& dir);

// The folder's `*.safetensors` files (not those in its subfolders: NeMo Automodel's `consolidated/`
// holds the same tensors whole) as one Metadata.
Result<Metadata> read_hf_storage_folder(const std::filesystem::path& dir);

// torch's FileSystemWriter(serialization_format=SAFETENSORS): a DCP with a `.metadata` whose data
// files hold a rank's bytes items (torch.save'd, where the metadata says) followed by one
// safetensors blob of its tensors, keyed by FQN and placed by DCP_SHARDING_INFO as above; the
// metadata gives every tensor chunk the blob's start as its offset (torch's own FileSystemReader
// cannot read such a DCP back). Each tensor chunk's storage is pointed at its elements in the blob
// (stored raw); `md` is left as it is where no data file holds such a blob. Refuses, naming the
// file and item: a chunk the blob does not hold at its offsets, or holds with another shape, dtype
// or byte length than the metadata's.
Result<bool> resolve_safetensors_blobs(const std::filesystem::path& dir, Metadata& md);

}  // namespace optstate::dcp::hf_storage
