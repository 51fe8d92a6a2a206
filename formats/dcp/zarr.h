// Megatron-Core's zarr backend (`--ckpt-format zarr`; NeMo 1.x's `dist_ckpt_format: zarr`, its
// default before torch_dist): the same sharded state dict as torch_dist (megatron.h), each
// ShardedTensor's key a zarr v2 array of the whole tensor in a folder of that name, beside
// `common.pt` and `metadata.json` ({"sharded_backend": "zarr"}). An array is `.zarray` (JSON: shape,
// chunks, dtype) and one file per chunk, named by its grid index ("0.1.0"), each the chunk's
// elements uncompressed in C order; ShardedObjects are torch.save files `<key>/shard_<...>.pt`.
// Layout and what is refused: FORMAT.md, "Megatron's zarr backend".
//
// Parsing is pure (parse_zarray over the document's bytes); read_zarr_folder is the edge that lists
// the folder and sizes its files, giving the DCP reader a Metadata whose chunks are raw storage.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dcp_layout.h"
#include "optstate/dtype.h"
#include "optstate/status.h"

namespace optstate::dcp::zarr {

// One array's `.zarray`, as far as optstate reads arrays: uncompressed, unfiltered, C order.
struct Array {
  std::vector<int64_t> shape, chunks;
  DType dtype = DType::kF32;
  char separator = '.';  // dimension_separator: "." (zarr's default) or "/" (nested folders)
};

// The `.zarray` document. Refuses, naming why: not zarr_format 2, a compressor or filters, F order,
// a dtype not in the table (big-endian, structured, "<V2"), shape/chunks that disagree or are out of
// range, more chunks or larger ones than read (caps below).
Result<Array> parse_zarray(std::string_view json, const std::string& where);

constexpr uint64_t kMaxZarrayBytes = uint64_t{1} << 16;
constexpr int64_t kMaxChunksPerArray = int64_t{1} << 20;
constexpr uint64_t kMaxChunkBytes = uint64_t{1} << 40;

// How many chunks the array has (the grid: ceil(shape / chunks) per axis; one for a 0-d array).
int64_t chunk_count(const Array& a);
// A chunk's file name, relative to the array's folder: its grid index joined by the separator ("0"
// for a 0-d array).
std::string chunk_file_name(std::span<const int64_t> index, char separator);
// Bytes of every chunk file: zarr stores an edge chunk whole (its elements beyond the array unused).
uint64_t chunk_bytes(const Array& a);

// One chunk of the grid: its index, and the box of the array it covers (sizes clipped at the edge).
struct GridChunk {
  std::vector<int64_t> index;
  ChunkMeta box;
};
// The grid's chunks in C order of their indices.
std::vector<GridChunk> chunk_grid(const Array& a);
// Whether a chunk's box is a C-order prefix of its stored elements (every interior chunk; an edge
// chunk clipped on one axis, the axes before it one wide): read as a tensor of the box's shape.
bool box_is_prefix(const std::vector<int64_t>& sizes, const std::vector<int64_t>& chunks);

// Whether folder `name` is zarr's ProcessSynchronizer lock folder of array `<key>` (`<key>.sync`,
// beside it among `sorted_names`: Megatron's flattened tensors' writers lock the chunks they share),
// empty lock files named as the array's own.
bool is_lock_folder(const std::string& name, const std::vector<std::string>& sorted_names);

// The folder as a DCP Metadata: each array an item (its whole shape, its chunks), each chunk's
// storage its file (StorageLoc::raw_shape: the elements themselves); each ShardedObject file a
// bytes item `<key>/shard_<...>`. Refuses a missing or wrongly sized chunk file, naming it.
// Lock folders are passed by; other entries are left to the caller.
Result<Metadata> read_zarr_folder(const std::filesystem::path& dir);

}  // namespace optstate::dcp::zarr
