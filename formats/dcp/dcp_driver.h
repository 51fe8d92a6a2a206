// Internal to formats/dcp: the writer half of the driver (dcp_writer.cpp), and what a DCP reader
// tells it when a DCP is written from a DCP (convert DCP -> DCP keeps the source's layout and
// carries the rest of it through).
#pragma once

#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "dcp_layout.h"
#include "optstate/checkpoint.h"
#include "optstate/io.h"
#include "zip.h"

namespace optstate::dcp {

// A planner_data path: dict keys, and list indices where `index` says so.
struct PlannerPath {
  std::vector<std::string> parts;
  std::vector<bool> index;
};

// An item's flat key and its planner_data path (absent where the source has none).
struct ItemName {
  std::string key;
  std::optional<PlannerPath> path;
};

// An item of the source that the canonical state does not hold, copied byte for byte.
struct CarriedItem {
  ItemName name;
  ItemMeta meta;
  std::vector<StorageLoc> pieces;  // one per chunk (in meta.chunks order), or one for a bytes item
};

// How a DCP source lays out the optimizer, and what else it holds.
struct SourceLayout {
  std::filesystem::path dir;
  // Where the optimizer state sits in the state dict: {"optim"} from get_state_dict, {"optimizer"}
  // in torchtitan, {"app", "optimizers"} in prime-rl (a Stateful under "app"), {} where it is the
  // whole state dict. The weights are
  // <parent>.model.<fqn>, or <fqn> at the top level (torchtitan), parent = the path without its last key.
  std::vector<std::string> optimizer_path{"optim"};
  std::string optimizer_key() const;                   // the path joined with '.'
  // Empty for an optimizer saved as the whole state dict (dcp.save(opt.state_dict())), which has no
  // weights beside it.
  std::vector<std::string> parent() const {
    return optimizer_path.empty() ? std::vector<std::string>{}
                                  : std::vector<std::string>{optimizer_path.begin(), optimizer_path.end() - 1};
  }
  // Where the model's dict lies (<this>.model.<fqn>): the parent, or where the parent holds none, the
  // nearest ancestor that does. Composer nests its optimizers by class name under its state
  // ({"state": {"model": ..., "optimizers": {"DecoupledAdamW": ...}}}).
  std::optional<std::vector<std::string>> model_path;
  std::vector<std::string> model_parent() const { return model_path ? *model_path : parent(); }
  bool flattened = false;               // flatten_optimizer_state_dict=True: per-param param_groups fields
  // The state keyed by param number as optimizer.state_dict() keys it (`<K>.state.<n>.<entry>`,
  // `params` a list of ints): a DCP of {"model": model.state_dict(), "optimizer":
  // optimizer.state_dict()}, or torch's own torch_save_to_dcp of such a file. Numbered the same
  // way when written (group by group, as torch numbers).
  bool numbered = false;
  // Each group's params as the source numbered them, those without state or weights too (which the
  // state cannot hold: no shape): written again where the params kept their numbers, so the groups
  // stay the optimizer's (torch's load_state_dict matches their sizes).
  std::vector<std::vector<int64_t>> numbered_members;
  bool numbers_kept = false;  // numbered and not named (no model or param_names named them)
  std::vector<std::string> item_order;  // the source's item keys in its metadata's order
  std::map<std::string, ItemName> weights;  // fqn -> where its weights were (model.<fqn>, or <fqn> in torchtitan)
  std::set<std::string> tensor_lr;      // fqns whose group's lr was a 0-d tensor (torchao keeps it so)
  bool torchao_8bit = false;            // some moment was torchao's OptimState8bit (AdamW8bit's) items
  std::string_view torchao_package;     // where its torchao subclasses were defined (kTorchaoOptimPackages)
  std::vector<AdamWFlags> adamw_flags;  // each group's torch.optim.AdamW switches (CheckpointReader::adamw_flags)
  std::vector<GroupExtras> group_extras;  // each group's other plain keys (CheckpointReader::group_extras)
  // Composer's DecoupledAdamW (its optimizer under <...>.optimizers.DecoupledAdamW), per group: the
  // weight_decay the file holds (a step decays by weight_decay * lr / initial_lr), as read
  // (AdamW's: divided by initial_lr), and initial_lr. A DCP write in this layout writes the file's
  // back where the group's is the one read, else AdamW's times initial_lr. Empty for any other.
  struct DecoupledDecay {
    double saved = 0, read = 0, initial_lr = 0;
  };
  std::vector<DecoupledDecay> decoupled_decay;
  std::vector<CarriedItem> carried;     // everything else, in key order
  // Entries of `dir` that are none of the DCP's own (not .metadata, not a data file, not hidden):
  // Lightning's meta.pt (its loops, callbacks and schedulers, without which Lightning does not take
  // the folder for its checkpoint), a run's config. Copied as they are by DCP -> DCP.
  std::vector<std::string> beside;
  // Megatron-Core's torch_dist checkpoint (megatron.h): read, never written back in its layout.
  bool megatron = false;
  // The number a bytes item or a one-element tensor item of the source holds (for float_lr).
  std::function<Result<double>(const std::string& key)> number;
};

// The index of the torch.save archive an item's bytes hold: its end records (from the last bytes)
// and its central directory, read and parsed (entries stored, named once, inside the archive).
// The bytes read to find them are kept: the last ones (all of a record of up to 64 KiB, as most
// of a wide DCP's chunks are) and, once read_archive_head, the first, where data.pkl and the local
// headers lie. read_archive_bytes serves reads from them: one pread a small record, not one for
// each of its end records, directory, headers and pickle (six a chunk, most of the time a DCP of
// hundreds of ranks took to read).
struct ArchiveIndex {
  zip::CentralDirectory cd;
  std::vector<zip::Entry> entries;
  std::vector<std::byte> tail;  // the archive's last tail.size() bytes
  std::vector<std::byte> head;  // its first head.size() bytes (none where the tail holds them)
};
Result<ArchiveIndex> read_archive_index(const InputFile& file, const StorageLoc& loc, const std::string& where,
                                        bool allow_compressed = false);
// Reads the first `bytes` of the archive into index.head, unless the tail already holds them.
Status read_archive_head(const InputFile& file, const StorageLoc& loc, ArchiveIndex& index, uint64_t bytes,
                         const std::string& where);
// `out.size()` bytes at archive offset `at` (checked to lie inside it): from the kept bytes where
// they hold them, else read.
Status read_archive_bytes(const InputFile& file, const StorageLoc& loc, const ArchiveIndex& index, uint64_t at,
                          std::span<std::byte> out, const std::string& where);

// Items stored through torch's stream transforms (FileSystemWriter(_extensions=[ZStandard()])):
// each descriptor must be one optstate decodes ("stream.zstd/1"; torch takes any 1.x), else an
// error naming it and the item.
Status check_transforms(const StorageLoc& loc, const std::string& where);
// The most bytes an item's stored archive may decode to: its chunk's elements (of the item's
// dtype) twice over and 16 MiB more for the archive around them; for a bytes item (no chunk), 1 GiB.
uint64_t stored_bytes_cap(const ItemMeta& im, const ChunkMeta* chunk);
// What it is expected to decode to: its chunk's bytes and 64 KiB for the archive around them (0:
// not known, a bytes item).
uint64_t stored_bytes_hint(const ItemMeta& im, const ChunkMeta* chunk);
// A transformed item's bytes decoded, as a file of their own (InputFile::made: let go under memory
// pressure and decoded again when read).
Result<InputFile> decoded_item(const InputFile& file, const StorageLoc& loc, uint64_t max_out, uint64_t size_hint,
                               const std::string& where);

// What the readers take: a DCP's `.metadata`, and a torch.save archive's data.pkl (torchsave/'s
// reader: torch pickles about 230 bytes a param of AdamW state). The writers check what they
// write against them: a file its own reader refuses is no checkpoint.
inline constexpr uint64_t kMaxMetadataBytes = uint64_t{1} << 30;
inline constexpr uint64_t kMaxArchivePickleBytes = uint64_t{1} << 30;

// One torch.save archive written to `out` from its current offset, laid out as torch.save lays it
// out (folder "archive"): begin() writes data.pkl and the small records, storage() each
// data/<key> (64-byte aligned, with its CRC-32), finish() the version record and the central
// directory and gives the archive's length. Offsets count from where the archive began (a DCP item
// sits inside a larger file).
class ArchiveWriter {
 public:
  explicit ArchiveWriter(OutputFile& out) : out_(out), start_(out.offset()) {}
  Status begin(std::span<const std::byte> pkl);
  Status storage(const std::string& key, std::span<const std::byte> bytes);
  // A storage of `size` bytes written in pieces: begin, append until `size` bytes, end (which patches
  // the CRC-32 into its local header). One at a time per archive.
  Status begin_storage(const std::string& key, uint64_t size);
  Status append(std::span<const std::byte> bytes);
  Status end_storage();
  Result<uint64_t> finish();

 private:
  Status put(const std::string& name, std::span<const std::byte> data);
  OutputFile& out_;
  uint64_t start_;
  zip::Builder zb_;
  struct Streamed {
    uint64_t header_at = 0, left = 0;
    uint32_t crc = 0;
  };
  std::optional<Streamed> streamed_;
};

// The layout of `reader` when it is a DCP reader, else null.
const SourceLayout* source_layout(const CheckpointReader& reader);

// Whether a write stores 8-bit moments as torchao's OptimState8bit items (the 8-bit state a DCP
// consumer steps) rather than dequantized for torch.optim.AdamW: for convert --to 8bit, and from a
// DCP of torchao's AdamW8bit (its layout kept); never with float_lr (torch.optim.AdamW's state).
bool writes_torchao_items(const WriteOptions& options, const SourceLayout* source);
// The package that 8-bit moments written as torchao's subclasses name: WriteOptions::torchao_package
// (refused unless one of kTorchaoOptimPackages), else the source's (CheckpointReader::torchao_package:
// a reshard or conversion keeps what that torchao release loads), else torchao.optim.
Result<std::string_view> written_torchao_package(const WriteOptions& options);
// What convert says of `kept`'s 8-bit moments written as torchao's subclasses with `options`: which
// torchao releases load them, where that is not simply today's (the package is the older one, or the
// source's was); empty otherwise (no 8-bit moment, or nothing to say).
std::vector<std::string> torchao_package_notes(const OptimizerState& kept, const WriteOptions& options);
// Whether blockwise8 entry `e`, moment `moment` of a param of `shape`, is written as torchao's
// items when laid out as `world` ranks' row shards: torchao steps it as 8-bit (whole blocks of its
// map) and every rank's rows are whole blocks (torchao slices its state on block boundaries only).
bool fits_torchao_items(const std::string& moment, const Entry& e, const std::vector<int64_t>& shape, int world);

// Writes `state` as a DCP directory, one entry loaded at a time; with `source`, in its layout and
// with its carried items.
Status write_dcp(StateSource& state, const std::filesystem::path& path, const WriteOptions& options,
                 const SourceLayout* source);

}  // namespace optstate::dcp
