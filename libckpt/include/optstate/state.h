// The canonical optimizer state (../shared/DESIGN.md §1): produced by both optimizers and by every
// format reader, consumed by every writer and by hash/validate/diff/convert. Free of LibTorch so the
// CLI and the format drivers build without it; optim/ bridges to tensors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "optstate/dtype.h"
#include "optstate/status.h"

namespace optstate {

inline constexpr int kStateFormatVersion = 1;

// Read-only bytes with shared ownership: a std::vector, an mmap, or a LibTorch tensor's storage
// (the bridge keeps the tensor alive through `owner`), so exporting state copies nothing.
struct Buffer {
  const std::byte* data = nullptr;
  size_t size = 0;
  std::shared_ptr<const void> owner;

  static Buffer copy_of(std::span<const std::byte> bytes);
  static Buffer take(std::vector<std::byte> bytes);
  // `size` uninitialized bytes owned by the Buffer, for a reader to fill through `out`
  // (no zeroing pass over memory that is about to be overwritten).
  static Buffer allocate(size_t size, std::span<std::byte>* out);
  std::span<const std::byte> span() const { return {data, size}; }
  bool empty() const { return size == 0; }
};

enum class Encoding : uint8_t { kDense, kBlockwise8 };
std::string_view encoding_name(Encoding e);
Result<Encoding> encoding_from_name(std::string_view name);

// The byte arrays an entry is made of. Dense: values. Blockwise8: codes (one u8 per element) and
// absmax (one f32 per block).
enum class Component : uint8_t { kValues, kCodes, kAbsmax };
std::string_view component_name(Component c);
Result<Component> component_from_name(std::string_view name);

struct Entry {
  Encoding encoding = Encoding::kDense;
  DType dtype = DType::kF32;  // dense: the values' dtype; blockwise8: always u8 codes + f32 absmax
  int64_t block_size = 0;     // blockwise8 only
  std::string qmap;           // blockwise8 only: "dynamic-signed" or "dynamic-unsigned"
  // Filled when the state is in memory; empty when only metadata was read (streaming readers).
  Buffer values, codes, absmax;

  std::vector<Component> components() const;
  const Buffer& buffer(Component c) const;
  Buffer& buffer(Component c);
};

// Well-known entry names. "param" carries the model weights where a checkpoint has them.
inline constexpr const char* kExpAvg = "exp_avg";
inline constexpr const char* kExpAvgSq = "exp_avg_sq";
inline constexpr const char* kMaxExpAvgSq = "max_exp_avg_sq";
inline constexpr const char* kParam = "param";

// "exp_avg" for ("exp_avg_codes", "_codes"): the moment a name of optstate's Python state (DESIGN
// §6: `<moment>_codes`, `<moment>_absmax`) belongs to, where it is one with that suffix.
std::optional<std::string> moment_of(const std::string& name, std::string_view suffix);

struct ParamState {
  std::vector<int64_t> shape;  // global shape
  DType param_dtype = DType::kF32;
  int64_t step = 0;
  int group = 0;  // index into OptimizerState::groups
  std::map<std::string, Entry> entries;
};

// The same number: equal, or both NaN (a group whose lr is NaN is still that group).
inline bool same_number(double a, double b) { return a == b || (a != a && b != b); }

struct Hyperparameters {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 1e-2;
  bool amsgrad = false, maximize = false;
  bool operator==(const Hyperparameters& o) const {
    return same_number(lr, o.lr) && same_number(beta1, o.beta1) && same_number(beta2, o.beta2) &&
           same_number(eps, o.eps) && same_number(weight_decay, o.weight_decay) && amsgrad == o.amsgrad &&
           maximize == o.maximize;
  }
};

// The first of a group's numbers (lr, betas[0], betas[1], eps, weight_decay) that is NaN or
// infinite, by name and value; none where all are finite.
std::optional<std::pair<const char*, double>> nonfinite_hyperparameter(const Hyperparameters& h);

struct ParamGroup {
  Hyperparameters hyper;
  std::vector<std::string> params;  // member fqns, in the optimizer's order
};

struct OptimizerState {
  int format_version = kStateFormatVersion;
  std::string kind = "adamw";  // "adamw" | "adamw8bit"
  std::vector<ParamGroup> groups;
  std::map<std::string, ParamState> params;  // by fully qualified name
};

// Caps that every reader applies before allocating anything a file asks for.
inline constexpr int kMaxRank = 16;
inline constexpr int64_t kMaxNumel = int64_t{1} << 44;  // 16 Ti elements: far beyond any real tensor

// Checked product of a shape; fails on negative dims, too many dims or overflow past kMaxNumel.
Result<int64_t> checked_numel(const std::vector<int64_t>& shape);
// Number of elements (values/codes) or blocks (absmax) of a component.
int64_t component_count(const Entry& e, Component c, int64_t numel);
// Bytes per element of a component.
int64_t component_elem_size(const Entry& e, Component c);
// Total bytes of a component for an entry of `numel` elements.
int64_t component_bytes(const Entry& e, Component c, int64_t numel);

// Index of the first byte at which `s` stops being UTF-8 (RFC 3629: no surrogates, overlong forms
// or code points past U+10FFFF), or -1 when all of it is.
int64_t utf8_error_at(std::string_view s);
// `s` for a message: bytes that are not UTF-8, and control characters, written as \xNN.
std::string printable(std::string_view s);

// Param names (and those the groups list) must be UTF-8 text without control characters: manifests,
// JSON output, HDF5 and safetensors names are text, and `hash` prints one name per line. A Python
// string with a lone surrogate pickles as bytes that are not UTF-8; such a name is refused by name.
Status check_names(const OptimizerState& state);

// Checks the structure (not the values) of a state: names (check_names), group indices, entry
// encodings, block sizes, and, for in-memory state, that every buffer has exactly the bytes its
// shape implies.
Status check_structure(const OptimizerState& state, bool require_buffers);

// "<fqn>.<entry>", the name used by hash, diff and every flat format.
inline std::string entry_key(const std::string& fqn, const std::string& entry) { return fqn + "." + entry; }

std::string format_shape(const std::vector<int64_t>& shape);

// The contiguous flat range [begin, end) of a component that `rank` of `world` owns (DESIGN §2):
// dense values split by whole rows of dim 0 like FSDP2's torch.chunk (ceil-sized, trailing ranks
// short or empty); 8-bit codes and absmax split the same way where every rank's rows begin on a
// quantization block (rows per rank x row length a multiple of the block: FSDP2's layout, which
// optstate's AdamW8bit steps), else by whole blocks (ceil-sized too), so blocks never straddle
// ranks. Ranges are in the component's own units (elements, or blocks for absmax).
struct FlatRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};
FlatRange shard_range(const Entry& e, Component c, const std::vector<int64_t>& shape, int world, int rank);

}  // namespace optstate
