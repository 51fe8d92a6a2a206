// PyTorch DCP on disk, interpreted from pickles without running them (FORMAT.md beside this file):
// the `.metadata` (Metadata / TensorStorageMetadata / ChunkStorageMetadata / MetadataIndex /
// _StorageInfo dataclasses, torch.Size, dtypes) and the torch.save payload of each item (a tensor
// rebuilt by _rebuild_tensor_v2/_v3, torchao's OptimState8bit rebuilt through
// _rebuild_from_type_v2 + _rebuild_wrapper_subclass, or a plain Python value).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "optstate/checkpoint.h"
#include "optstate/dtype.h"
#include "optstate/status.h"
#include "pickle.h"

namespace optstate::dcp {

struct ChunkMeta {
  std::vector<int64_t> offsets, sizes;
};

struct ItemMeta {
  bool is_tensor = false;
  DType dtype = DType::kF32;
  std::vector<int64_t> size;
  std::vector<ChunkMeta> chunks;
  // Megatron-Core's N-D flattened item (its distributed optimizer saved fully_sharded_model_space):
  // the tensor's own shape (mcore_data's nd_reformulated_orig_global_shape). The item's `size` is
  // then [*chunks per axis, elements per chunk]: each chunk box of the tensor (the shape divided by
  // the chunk counts, at chunk index * box) one row, and each DCP chunk (i..., start) of sizes
  // (1..., n) elements [start, start + n) of that box in C order. Empty for any other item.
  std::vector<int64_t> nd_shape;
};

// The shape of the tensor an item holds: its nd_shape where it has one, else its size.
inline const std::vector<int64_t>& tensor_shape(const ItemMeta& im) { return im.nd_shape.empty() ? im.size : im.nd_shape; }

struct StorageLoc {
  std::string relative_path;
  uint64_t offset = 0, length = 0;
  // transform_descriptors: what the stored bytes went through ("stream.zstd/1": torch's ZStandard
  // extension), as listed; empty for plain bytes.
  std::vector<std::string> transforms;
  // Megatron's zarr backend (zarr.h): the bytes are the chunk's elements themselves, in C order, of
  // the item's dtype and this shape (no torch.save archive around them, no CRC).
  std::optional<std::vector<int64_t>> raw_shape;
};

// An item's chunk by (key, chunk offsets), as a view: looked up in the maps keyed by copies of
// them without making one (a DCP of hundreds of ranks looks up hundreds of thousands).
struct ChunkView {
  std::string_view key;
  std::span<const int64_t> offsets;
};
using ChunkKey = std::pair<std::string, std::vector<int64_t>>;
inline ChunkView chunk_view(const ChunkView& c) { return c; }
inline ChunkView chunk_view(const ChunkKey& k) { return {k.first, k.second}; }
// Orders chunk keys and views alike: by key, then offsets.
struct ChunkLess {
  using is_transparent = void;
  template <class A, class B>
  bool operator()(const A& a, const B& b) const {
    const ChunkView x = chunk_view(a), y = chunk_view(b);
    if (const int c = x.key.compare(y.key); c != 0) return c < 0;
    return std::lexicographical_compare(x.offsets.begin(), x.offsets.end(), y.offsets.begin(), y.offsets.end());
  }
};

struct Metadata {
  std::map<std::string, ItemMeta> items;                                   // flat key -> meta
  std::vector<std::string> order;  // the keys as the state dict held them (module order for a model's)
  std::map<ChunkKey, StorageLoc, ChunkLess> storage;  // (key, chunk offsets) -> where
  std::map<std::string, std::vector<std::string>> planner;                 // flat key -> path (ints as text)
  std::map<std::string, std::vector<bool>> planner_index;                  // which parts of that path are ints
};

Result<Metadata> interpret_metadata(const pickle::Pickle& p, const std::string& where);

// Whether item `im` can be Megatron-Core's N-D flattened form of a tensor of shape `nd` (ItemMeta::
// nd_shape): one axis more, each of the tensor's axes cut in `size[d]` equal chunks, the last axis a
// chunk box's elements, every DCP chunk inside one box. The error names `where` and both shapes.
Status check_nd_flattened(const ItemMeta& im, const std::vector<int64_t>& nd, const std::string& where);

struct TensorRef {
  std::string storage_key;  // the zip entry "<archive>/data/<key>"
  DType dtype = DType::kF32;
  int64_t storage_numel = 0;  // elements of dtype in the storage
  int64_t offset = 0;         // storage offset, elements
  std::vector<int64_t> shape;
  // Empty for a C-contiguous tensor. Otherwise its strides, a permutation of a dense layout (a
  // channels_last conv weight, a transposed tensor, as torch.save and DCP store them): its elements
  // are still the `numel` at `offset`, in another order (to_logical_order).
  std::vector<int64_t> stride;
  bool permuted() const { return !stride.empty(); }
};

// A permuted tensor's elements in logical (row-major) order: `stored` holds its numel elements of
// `elem` bytes as they lie from its offset, `out` receives them (both numel * elem bytes).
void to_logical_order(const TensorRef& t, int64_t elem, std::span<const std::byte> stored, std::span<std::byte> out);

// Refuses a permuted tensor where only C-contiguous data is read (8-bit codes and scales, maps).
Status require_contiguous(const TensorRef& t, const std::string& where);

struct Payload {
  enum class Kind { kTensor, kOptimState8bit, kValue } kind = Kind::kValue;
  TensorRef tensor;              // kTensor
  TensorRef codes, scale, qmap;  // kOptimState8bit
  std::vector<int64_t> claimed_shape;  // kOptimState8bit: the shape the subclass claims
  std::optional<DType> claimed_dtype;  // kOptimState8bit: its dtype (torchao: the param's, "appearance" only)
  // torchao's OptimStateFp8 (AdamWFp8), read as kOptimState8bit: codes are float8_e4m3fn bit
  // patterns (kU8), no qmap; value = float8_e4m3fn_values()[code] * scale[block], always read
  // dequantized (its map is no canonical one).
  bool fp8 = false;
  // torchao's OptimState4bit (AdamW4bit), read as kOptimState8bit: 4 (two codes a byte, the first
  // in the high nibble; a 16-entry qmap), always read dequantized. 8 otherwise.
  int bits = 8;
  // kOptimState8bit: the package that defined the subclass (one of kTorchaoOptimPackages).
  std::string_view torchao_package;
  int64_t elements() const { return bits == 4 ? 2 * codes_numel() : codes_numel(); }
  int64_t codes_numel() const {
    int64_t n = 1;
    for (int64_t d : codes.shape) n *= d;
    return n;
  }
};

// The 256 values of float8_e4m3fn, by bit pattern (NaN at 0x7f and 0xff; no infinities).
const std::array<float, 256>& float8_e4m3fn_values();

// The meaning of a torch.save data.pkl. Tensors must be views inside their storage, C-contiguous or
// a permutation of a dense layout (TensorRef::stride).
Result<Payload> interpret_payload(const pickle::Pickle& p, const std::string& where);

// Composer's DecoupledAdamW decays each weight by weight_decay * lr / initial_lr a step, where
// AdamW decays it by weight_decay * lr: the same update as AdamW's with weight_decay / initial_lr,
// at every lr a schedule gives. Returns that AdamW weight decay of group `group` (named
// `group_where` in errors) and adds a note saying so; without a positive initial_lr (the decay is
// then weight_decay at any lr, which no AdamW weight decay is) it is refused. 0 stays 0, unnoted.
Result<double> adamw_decay_of_decoupled(double weight_decay, std::optional<double> initial_lr, size_t group,
                                        const std::string& group_where, std::vector<std::string>& notes);

// Where torchao defines its optimizer-state subclasses (OptimState8bit in `<package>.subclass_8bit`):
// torchao.optim since torchao 0.11, torchao.prototype.low_bit_optim before. A pickle names the
// defining module, so checkpoints of older torchao name the second; both are read alike.
inline constexpr std::string_view kTorchaoOptimPackages[] = {"torchao.optim", "torchao.prototype.low_bit_optim"};

// The package whose `<package>.<module>.<name>` the GLOBAL `r` names (one of kTorchaoOptimPackages),
// or an empty view when it names neither package's torchao subclass `name`.
std::string_view torchao_subclass_package(const pickle::Pickle& p, pickle::Ref r, std::string_view module,
                                          std::string_view name);
// The package writers name when none is chosen: today's torchao.
inline constexpr std::string_view kTorchaoDefaultPackage = kTorchaoOptimPackages[0];
// Whether `package` is one of kTorchaoOptimPackages.
bool is_torchao_package(std::string_view package);
// The same for one value inside a larger pickle (a tensor in a torch.save'd state_dict).
Result<Payload> interpret_value(const pickle::Pickle& p, pickle::Ref r, const std::string& where);

// Encoding (the writers): a C-contiguous tensor of `shape` over the whole of storage `storage_key`
// (torch._utils._rebuild_tensor_v2 with a persistent id, as torch.save writes it).
void encode_tensor(pickle::Writer& w, DType d, const std::vector<int64_t>& shape, std::string_view storage_key);
// The same for any view: its strides and storage offset, in a storage of `storage_numel` elements.
void encode_tensor_view(pickle::Writer& w, DType d, const std::vector<int64_t>& shape,
                        const std::vector<int64_t>& stride, int64_t offset, int64_t storage_numel,
                        std::string_view storage_key);

// Reading helpers over the pickle's value model, for the interpretation layers (here and the
// torch.save driver's).
// A dataclass's or NEWOBJ+BUILD object's fields: BUILD state as a dict, or the dict of a
// (None, slots dict) state; kNoRef otherwise.
pickle::Ref fields_of(const pickle::Pickle& p, pickle::Ref obj);
// An object made by calling (REDUCE) or instantiating (NEWOBJ) the global module.name.
bool is_instance(const pickle::Pickle& p, pickle::Ref obj, std::string_view module, std::string_view name);
std::optional<std::vector<int64_t>> int_tuple(const pickle::Pickle& p, pickle::Ref r);
// torch.Size((d0, d1, ...)) or a plain tuple of ints.
std::optional<std::vector<int64_t>> torch_size(const pickle::Pickle& p, pickle::Ref r);
// The global torch.<dtype name>.
std::optional<DType> torch_dtype(const pickle::Pickle& p, pickle::Ref r);

// Plain values of bytes items.
std::optional<double> as_number(const pickle::Pickle& p, pickle::Ref r);
std::optional<bool> as_bool(const pickle::Pickle& p, pickle::Ref r);
std::optional<std::vector<std::string>> as_string_list(const pickle::Pickle& p, pickle::Ref r);
std::optional<std::vector<int64_t>> as_int_list(const pickle::Pickle& p, pickle::Ref r);
std::optional<std::string> as_string(const pickle::Pickle& p, pickle::Ref r);

// ---- torch.optim.AdamW's implementation switches (CheckpointReader::adamw_flags) ----
// A switch's value: None, False or True; nullopt for anything else (not kept: the writer's default).
std::optional<FlagValue> as_flag(const pickle::Pickle& p, pickle::Ref r);
// Group `g`'s switches of a source's (kept for each of `groups` groups), or null: not this state's.
const AdamWFlags* source_flags(std::span<const AdamWFlags> source, size_t groups, size_t g);
// The switch `name` to write: the source's where it kept one (`kept` may be null), else `fallback`.
FlagValue written_flag(const AdamWFlags* kept, std::string_view name, FlagValue fallback);
void encode_flag(pickle::Writer& w, FlagValue v);

// ---- A param group's other keys (CheckpointReader::group_extras) ----
// Whether a param group's key is one the readers take or know (AdamW's fields and switches, the
// optimizers' own: optstate's 8-bit layout, torchao's, bitsandbytes', DeepSpeed's), not an extra.
bool known_group_key(std::string_view key);
// Refuses a param group (its keys as `has` tells them) that is torch.optim.NAdam's or RAdam's:
// their state has AdamW's keys, their updates are others.
Status check_torch_adam_group(const std::function<bool(const char*)>& has, const std::string& where);
// A plain value of a group (None, bool, int, float, str); nullopt for anything else (a tensor
// is read by the caller, which has its bytes).
std::optional<GroupValue> as_group_value(const pickle::Pickle& p, pickle::Ref r);
// Writes a plain value (not a kTensor one: the caller writes a tensor or, as_float, a float).
void encode_group_value(pickle::Writer& w, const GroupValue& v);
// Group `g`'s extras of a source's (kept for each of `groups` groups), or null.
const GroupExtras* source_extras(std::span<const GroupExtras> source, size_t groups, size_t g);
// "initial_lr=0.001", "name='decay'", "initial_lr=tensor(0.001)": as inspect and convert show it.
std::string group_value_text(const GroupValue& v);

}  // namespace optstate::dcp
