// The one small interface every format driver implements (a reader, a writer and a sniffer), and
// the operations built on it that do not care where bytes come from.
#pragma once

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "optstate/state.h"
#include "optstate/status.h"
#include "optstate/transform.h"

namespace optstate {

// Receives a component's bytes in flattened order, in pieces of bounded size.
using ByteSink = std::function<Status(std::span<const std::byte>)>;

// Upper bound on the piece size handed to a ByteSink, so streaming stays in bounded memory.
inline constexpr size_t kStreamPieceBytes = size_t{8} << 20;

// A sink that fills `out` from its start, piece after piece: a range read served by a stream. A
// piece past the end of `out` is an internal error, not a write.
inline ByteSink filling(std::span<std::byte> out) {
  auto done = std::make_shared<size_t>(0);
  return [out, done](std::span<const std::byte> piece) {
    if (piece.size() > out.size() - *done) return internal_error("a stream gave more bytes than its range holds");
    std::memcpy(out.data() + *done, piece.data(), piece.size());
    *done += piece.size();
    return Status::Ok();
  };
}

// Hands `bytes` (held in memory) to `sink` in pieces of at most kStreamPieceBytes.
inline Status sink_pieces(std::span<const std::byte> bytes, const ByteSink& sink) {
  for (size_t at = 0; at < bytes.size(); at += kStreamPieceBytes) {
    const Status st = sink(bytes.subspan(at, std::min(kStreamPieceBytes, bytes.size() - at)));
    if (!st.ok()) return st;
  }
  return Status::Ok();
}

// torch.optim.AdamW's implementation switches of a param group as a torch state_dict kept them
// (foreach, capturable, differentiable, fused: None, False or True; decoupled_weight_decay): how a
// run stepped, not what it computes, so outside the state model and its hash. Writers of torch's
// state_dicts keep the source's, so a fused run resumes fused; a switch absent here is torch's default.
enum class FlagValue : int8_t { kNone, kFalse, kTrue };
using AdamWFlags = std::map<std::string, FlagValue, std::less<>>;
// The switches, in torch.optim.AdamW's state_dict order, with torch 2.13's defaults.
inline constexpr std::pair<std::string_view, FlagValue> kAdamWFlagDefaults[] = {
    {"foreach", FlagValue::kNone},  {"capturable", FlagValue::kFalse},           {"differentiable", FlagValue::kFalse},
    {"fused", FlagValue::kNone},    {"decoupled_weight_decay", FlagValue::kTrue}};

// A param group's key that is neither an AdamW hyperparameter nor a switch nor an optimizer's own
// field: an LR scheduler's `initial_lr`, a layer-wise `lr_scale`, a group's `name`. Outside the
// state model and its hash; the writers of torch's state_dicts (torch.save, DCP) write it back, as
// the loop that reads the file looks for it (a scheduler rebuilt to resume asks for initial_lr).
// Plain values: None, a bool, an int, a float, a string, or a one-element float32 tensor (what a
// scheduler keeps where lr is a tensor, as torchao's is); a reader names any other as not read.
struct GroupValue {
  enum class Kind : int8_t { kNone, kBool, kInt, kFloat, kString, kTensor };
  Kind kind = Kind::kNone;
  int64_t i = 0;               // kBool (0 or 1), kInt
  double f = 0;                // kFloat; kTensor: its one element
  std::string s;               // kString
  std::vector<int64_t> shape;  // kTensor: [] or [1]
};
// A group's such keys, in the source's order.
using GroupExtras = std::vector<std::pair<std::string, GroupValue>>;

// A tensor of the model's state_dict saved beside the state that is no optimized param's weights:
// a buffer (BatchNorm's running stats), a tied weight's second name (nanoGPT's lm_head.weight), a
// frozen param's weights (a LoRA's base). Named as torch's state dicts name it (get_state_dict:
// wrappers' segments dropped), as dcp.load of get_state_dict(model) looks for it.
struct ModelTensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
};

class CheckpointReader {
 public:
  virtual ~CheckpointReader() = default;
  virtual std::string_view format() const = 0;
  virtual const std::filesystem::path& path() const = 0;
  // The state's metadata: every ParamState and Entry, with empty buffers.
  virtual const OptimizerState& meta() const = 0;
  // How many ranks' files hold it, where files are named by rank (a native checkpoint's rank
  // files, a DCP's __R_I.distcp, FSDP's, DeepSpeed's, Megatron's or nanotron's per-rank files): a
  // sharded run's world size (ranks holding only copies may save none). For inspect; nullopt for
  // one file, or files not named by rank.
  virtual std::optional<int64_t> ranks() const { return std::nullopt; }
  // What the file holds that the canonical state does not carry (a DCP's train_state,
  // lr_scheduler, dataloader, model buffers): one short line each, for inspect and convert to say
  // so. Empty for formats that hold only optimizer state.
  virtual std::vector<std::string> not_read() const { return {}; }
  // The lines of not_read() that a write carrying this checkpoint (FormatDriver::carries) keeps as
  // they are: all of them by default; not those that say how an entry was read (torchao's 4-bit
  // moments read as fp32 values), which a write from the state does not keep.
  virtual std::vector<std::string> carried_not_read() const { return not_read(); }
  // How the file's values were read where that is not as they stand (Composer's DecoupledAdamW
  // weight decay read as AdamW's equivalent): one line each, said by inspect and convert.
  virtual std::vector<std::string> read_notes() const { return {}; }
  // The Python package whose torchao tensor subclasses the file's 8-bit moments are (torchao.optim,
  // or torchao.prototype.low_bit_optim before torchao 0.11), for writers of torchao's state to name
  // the same by default (WriteOptions::torchao_package); empty where the file holds none.
  virtual std::string_view torchao_package() const { return {}; }
  // Each param group's AdamW switches (meta().groups' order) as the file kept them; empty where
  // it keeps none (optstate's own formats, torchao's and bitsandbytes' optimizers).
  virtual std::span<const AdamWFlags> adamw_flags() const { return {}; }
  // Each param group's other plain keys (meta().groups' order; GroupValue), where some group has
  // any; empty otherwise. Not in not_read(): convert says which a write keeps.
  virtual std::span<const GroupExtras> group_extras() const { return {}; }
  // The model's other tensors (ModelTensorInfo), where the file holds them beside the state and the
  // reader can stream them; not in not_read(): convert says whether a write keeps them
  // (FormatDriver::keeps_model_tensors). Empty for the formats that hold none.
  virtual std::span<const ModelTensorInfo> model_tensors() const { return {}; }
  // Model tensor `index`'s bytes (its dtype, C order), in pieces, checked against the file's
  // checksums where it keeps them.
  virtual Status stream_model_tensor(size_t index, const ByteSink& sink) const;
  // Whether every chunk read is checked against a stored checksum (native: XXH3; optstate's HDF5:
  // fletcher32; DCP: torch.save's CRC-32 of each record, known once the chunks were streamed).
  // safetensors stores none: a reader can check sizes and coverage only.
  virtual bool checksummed() const { return false; }
  // Where checksummed() is false, what the stored checksums leave unchecked, one phrase for validate
  // ("no checksums in this format"; an HDF5 file some of whose datasets another tool rewrote
  // without fletcher32 names how many and the first).
  virtual std::string unchecked() const { return "no checksums in this format"; }
  // validate's check of the stored checksums that reading entry by entry cannot check: a record
  // several entries share (torch.save's CRC-32 of a flat partition that ZeRO or FSDP1 split among
  // many params), read whole once each. An error names the file and record; afterwards
  // checksummed() says whether every byte read was covered.
  virtual Status verify_shared_records() { return Status::Ok(); }
  // validate's check of whole-file digests a writer kept beside its data (Megatron-Core's
  // integrity.json: each file's SHA-256). An error names the file whose bytes differ, that is gone,
  // or that the checkpoint reads but the manifest leaves out; otherwise what was verified, for
  // validate to say ("" where the checkpoint keeps no such digests).
  virtual Result<std::string> verify_file_digests() { return std::string(); }
  // Streams one component of one entry in flattened order. Formats with checksums verify every
  // chunk and fail (naming the file, the entry and the range) when one does not match.
  virtual Status stream(const std::string& fqn, const std::string& entry, Component c, const ByteSink& sink) = 0;
  // Elements [begin, end) of a component (units of the component: elements, or blocks for absmax)
  // into `out`, verified. The default streams the whole component; sharded formats read only the
  // chunks that overlap the range, which is how a rank loads its shard.
  virtual Status read_range(const std::string& fqn, const std::string& entry, Component c, int64_t begin,
                            int64_t end, std::span<std::byte> out);
  // Where element `index` of a component is stored, for messages ("<file> at byte <offset>");
  // formats without a finer answer give their path.
  virtual std::string locate(const std::string& fqn, const std::string& entry, Component c, int64_t index) const {
    return path().string();
  }

  // Where the checkpoint was found when a folder holding it was given (a training run's save
  // folder, through the tracker naming its latest save): one line each, said before read_notes().
  void add_located_note(std::string note) { located_notes_.push_back(std::move(note)); }
  const std::vector<std::string>& located_notes() const { return located_notes_; }
  // located_notes() then read_notes(): what inspect and convert say.
  std::vector<std::string> all_read_notes() const {
    std::vector<std::string> out = located_notes_;
    for (std::string& n : read_notes()) out.push_back(std::move(n));
    return out;
  }

 private:
  std::vector<std::string> located_notes_;
};

// What a writer writes: the whole state's metadata, and each entry's bytes when the writer comes to
// it. Writers load one entry at a time and let it go before the next, so `convert` holds one entry
// in memory, not the checkpoint: SRC may be larger than RAM.
class StateSource {
 public:
  virtual ~StateSource() = default;
  // Every param and entry with its metadata; buffers empty (writers read bytes through load()).
  virtual const OptimizerState& meta() const = 0;
  // Entry `name` of param `fqn` as meta() describes it, its buffers filled with exactly the bytes
  // its shape implies (checked: a source that gives other sizes fails, naming the entry).
  virtual Result<Entry> load(const std::string& fqn, const std::string& name) = 0;
};

// Over a state in memory, borrowed (it must outlive the source); load() shares its buffers.
std::unique_ptr<StateSource> memory_source(const OptimizerState& state);
// Over a reader: load() streams the entry's components, verified as the reader verifies them.
std::unique_ptr<StateSource> reader_source(CheckpointReader& reader);
// Over another source (borrowed), every entry recoded as recode_entry does: convert --to, and
// dequantize-on-save. `q` is checked by the first load.
std::unique_ptr<StateSource> recoded_source(StateSource& inner, Recode how, const QuantizeOptions& q = {});

struct WriteOptions {
  bool overwrite = false;   // replace an existing checkpoint (atomically, after the new one is durable);
                            // never anything else (check_destination in formats/registry.h)
  bool dequantize = false;  // store blockwise8 entries as dense fp32 (dequantize-on-save)
  int world_size = 1;       // lay the state out as this many ranks' shards (formats that shard)
  int compression = 0;      // gzip level 1-9 for formats that compress (hdf5: with shuffle); 0 none
  // DCP: lr as Python floats, as torch.optim.AdamW built with a float lr (torchtitan's) holds it,
  // also where the source kept tensors (torchao): the groups' lr and initial_lr, and an LR
  // scheduler's lists of tensor lrs (`base_lrs`, `_last_lr`) carried from the source.
  bool float_lr = false;
  // convert --to 8bit: the state was quantized for this write. Formats whose default consumer keeps
  // dense state store 8-bit moments in the form an 8-bit consumer steps where they have one (DCP:
  // torchao's OptimState8bit items; FormatDriver::writes_blockwise8).
  bool quantized = false;
  // The checkpoint `state` was read from (convert). A driver writing its own format may keep the
  // source's layout and carry through what the state does not hold (FormatDriver::carries).
  const CheckpointReader* source = nullptr;
  // The package whose torchao subclasses 8-bit moments written as torchao's are (torchao.optim, or
  // torchao.prototype.low_bit_optim for torchao before 0.11, whose pickles name their defining
  // module); empty: the source's (CheckpointReader::torchao_package), else torchao.optim.
  std::string torchao_package = {};
  // bitsandbytes' state_dict: its tensors "nested" in __bnb_optimizer_quant_state__ (as 0.49.2 and
  // later save them; what FSDP's gathering needs) or "flat" beside 'step' (as earlier releases save
  // them; every release loads it); empty: the source's (a bitsandbytes file), else nested.
  std::string bitsandbytes_layout = {};
};

class FormatDriver {
 public:
  virtual ~FormatDriver() = default;
  virtual std::string_view name() const = 0;
  // Cheap check from the first bytes / directory layout: is this path in my format?
  virtual bool sniff(const std::filesystem::path& path) const = 0;
  virtual Result<std::unique_ptr<CheckpointReader>> open(const std::filesystem::path& path) const = 0;
  // False for formats whose consumers keep dense state (DCP for torch.optim.AdamW): they store
  // blockwise8 entries dequantized, so a round trip keeps the values hash, not the raw one.
  virtual bool keeps_blockwise8() const { return true; }
  // Whether a write with `options` stores blockwise8 entries as 8-bit: keeps_blockwise8(), unless
  // the options choose another consumer (DCP: torchao's items for --to 8bit or a torchao source).
  virtual bool writes_blockwise8(const WriteOptions&) const { return keeps_blockwise8(); }
  // Whether a write lays the state out as WriteOptions::world_size ranks' shards (native, DCP); the
  // other formats write one file whatever the world size.
  virtual bool shards() const { return false; }
  // Whether a write honours WriteOptions::compression (HDF5's gzip); the others store as they are.
  virtual bool compresses() const { return false; }
  // What a round trip through this format gives back of `state`, encodings aside: the state itself
  // for formats that keep names and weights. LibTorch's optimizer archive numbers the params in group
  // order ("0", "1", ...) and holds no weights (so no param dtype, and nothing of a param without state).
  virtual OptimizerState kept(const OptimizerState& state) const { return state; }
  // The same for a write with `options` (DCP writing torchao's items: the 8-bit moments torchao
  // cannot step as 8-bit become fp32 values).
  virtual OptimizerState kept_by_write(const OptimizerState& state, const WriteOptions&) const { return kept(state); }
  // What a user of the written file should know of how it was written, one line each, for convert
  // and reshard to say (torchao's: which torchao releases load its 8-bit moments); `kept` is
  // kept_by_write's state.
  virtual std::vector<std::string> write_notes(const OptimizerState& kept, const WriteOptions&) const { return {}; }
  // The rule `convert --to 8bit` quantizes by for this format: `q` adjusted to what the format's
  // optimizer steps as 8-bit (torchao: whole blocks only), so no moment is quantized only to be
  // written back as its rounded fp32 values.
  virtual QuantizeOptions quantize_rule(const QuantizeOptions& q) const { return q; }
  // Whether this format writes any state (DeepSpeed's universal checkpoint is written only from a
  // DeepSpeed checkpoint, whose files it carries: WriteOptions::source; from anything else write fails).
  virtual bool writes() const { return true; }
  // Writes every entry of `source`, loading one at a time.
  virtual Status write(StateSource& source, const std::filesystem::path& path, const WriteOptions& options) const = 0;
  // A state in memory.
  Status write(const OptimizerState& state, const std::filesystem::path& path, const WriteOptions& options) const {
    return write(*memory_source(state), path, options);
  }
  // Whether a checkpoint this driver opens at `path` may be replaced by a write with
  // WriteOptions::overwrite: false where it is not optstate's to replace (a training run's folder
  // that holds per-rank torch.save files among its other files).
  virtual bool replaceable(const std::filesystem::path& path) const { return true; }
  // Whether a write to `path` with WriteOptions::source = &source keeps what source.not_read() names
  // (a DCP written from a DCP carries its train_state, lr_scheduler, ... through, byte for byte).
  virtual bool carries(const CheckpointReader& source, const std::filesystem::path& path) const { return false; }
  // Whether a write keeps the source's group extras (CheckpointReader::group_extras): the writers
  // of torch's state_dicts do; the state-only formats do not.
  virtual bool keeps_group_extras() const { return false; }
  // Whether a write keeps the source's model tensors (CheckpointReader::model_tensors): DCP writes
  // them as `model.<name>` items beside the weights.
  virtual bool keeps_model_tensors() const { return false; }
};

// Model tensor `index` of `reader` through `sink`, exactly the bytes its dtype and shape make: a
// reader that gives more or fewer fails, naming the tensor (writers and the Python face use this).
Status stream_model_tensor_exactly(const CheckpointReader& reader, size_t index, const ByteSink& sink);

// Writes through a driver after the option-driven transforms every driver shares (dequantize-on-save).
Status write_checkpoint(const FormatDriver& driver, StateSource& source, const std::filesystem::path& path,
                        const WriteOptions& options);
Status write_checkpoint(const FormatDriver& driver, const OptimizerState& state, const std::filesystem::path& path,
                        const WriteOptions& options);

// A reader over a state that is already in memory (buffers filled).
std::unique_ptr<CheckpointReader> memory_reader(OptimizerState state, std::filesystem::path label = "<memory>");

// Reads every component of every entry into memory.
Result<OptimizerState> load_all(CheckpointReader& reader);

}  // namespace optstate
