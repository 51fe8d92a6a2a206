// Writes a DCP directory in the layout torch.distributed.checkpoint.save produces for
// get_state_dict(model, AdamW): `model.<fqn>`, `optim.state.<fqn>.{step,exp_avg,exp_avg_sq[,max_exp_avg_sq]}`
// and `optim.param_groups.<i>.<field>` items in `__<rank>_0.distcp` files, then `.metadata` (pickle
// of the DCP dataclasses). Written from a DCP, in the source's layout instead (its optimizer key,
// flattened or nested groups, where its weights were) with every item the state does not hold
// copied through unchanged. 8-bit moments are written dequantized (fp32), as torch.optim.AdamW keeps
// them, or as torchao's OptimState8bit items (writes_torchao_items). Committed like every optstate checkpoint: staging directory, fsync, one rename.
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <set>

#include "dcp_driver.h"
#include "optstate/io.h"
#include "optstate/quant8.h"
#include "pickle.h"
#include "registry.h"
#include "torchao/torchao_layout.h"
#include "zip.h"

namespace optstate::dcp {
namespace {

constexpr const char* kMeta = "torch.distributed.checkpoint.metadata";

void write_size(pickle::Writer& w, const std::vector<int64_t>& dims) {
  w.global("torch", "Size");
  w.mark();
  w.mark();
  for (int64_t d : dims) w.integer(d);
  w.tuple_from_mark();
  w.tuple_from_mark();
  w.reduce();
}

// NEWOBJ of a dataclass, the caller then pushes the state and calls build().
void new_object(pickle::Writer& w, const char* module, const char* cls) {
  w.global(module, cls);
  w.empty_tuple();
  w.newobj();
}

// One torch.save archive: small entries plus, for tensors, the storage bytes as data/0.
class Item {
 public:
  explicit Item(std::string pkl) : pkl_(std::move(pkl)) {}
  // Writes the archive to `out`, returns its length.
  Result<uint64_t> write(OutputFile& out, std::span<const std::byte> storage, bool tensor) {
    ArchiveWriter archive(out);
    OPTSTATE_RETURN_IF_ERROR(archive.begin(std::as_bytes(std::span(pkl_))));
    if (tensor) OPTSTATE_RETURN_IF_ERROR(archive.storage("0", storage));
    return archive.finish();
  }

 private:
  std::string pkl_;
};

std::string tensor_pickle(DType d, const std::vector<int64_t>& shape) {
  pickle::Writer w;
  encode_tensor(w, d, shape, "0");
  return w.finish();
}

struct Piece {
  std::vector<int64_t> offsets, sizes;  // the chunk's box (empty for bytes items)
  int file = 0;                         // rank: __<file>_0.distcp
  uint64_t offset = 0, length = 0;
  std::vector<std::string> transforms;  // a carried piece's, kept with its bytes as stored
};

struct Written {
  std::string key;
  std::optional<PlannerPath> path;  // planner_data path; none where a carried item had none
  bool tensor = false;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<Piece> pieces;
};

std::string data_file(int rank) { return fmt::format("__{}_0.distcp", rank); }

std::string metadata_pickle(const std::vector<Written>& items) {
  pickle::Writer w;
  new_object(w, kMeta, "Metadata");
  w.empty_dict();
  w.mark();
  w.str("state_dict_metadata");
  w.empty_dict();
  w.mark();
  for (const Written& it : items) {
    w.str(it.key);
    if (!it.tensor) {
      new_object(w, kMeta, "BytesStorageMetadata");
      w.empty_dict();
      w.build();
      continue;
    }
    new_object(w, kMeta, "TensorStorageMetadata");
    w.empty_dict();
    w.mark();
    w.str("properties");
    new_object(w, kMeta, "TensorProperties");
    w.mark();  // (dtype, layout, requires_grad, memory_format, pin_memory)
    w.global("torch", std::string(dtype_info(it.dtype).torch_name));
    w.global("torch.serialization", "_get_layout");
    w.mark();
    w.str("torch.strided");
    w.tuple_from_mark();
    w.reduce();
    w.boolean(false);
    w.global(kMeta, "_MEM_FORMAT_ENCODING");
    w.mark();
    w.integer(0);
    w.tuple_from_mark();
    w.reduce();
    w.boolean(false);
    w.tuple_from_mark();
    w.build();
    w.str("size");
    write_size(w, it.shape);
    w.str("chunks");
    w.empty_list();
    w.mark();
    for (const Piece& pc : it.pieces) {
      new_object(w, kMeta, "ChunkStorageMetadata");
      w.empty_dict();
      w.mark();
      w.str("offsets");
      write_size(w, pc.offsets);
      w.str("sizes");
      write_size(w, pc.sizes);
      w.setitems_from_mark();
      w.build();
    }
    w.appends_from_mark();
    w.setitems_from_mark();
    w.build();
  }
  w.setitems_from_mark();
  w.str("planner_data");
  w.empty_dict();
  w.mark();
  for (const Written& it : items) {
    if (!it.path) continue;
    w.str(it.key);
    w.mark();
    for (size_t k = 0; k < it.path->parts.size(); ++k) {
      if (it.path->index[k]) w.integer(std::stoll(it.path->parts[k]));
      else w.str(it.path->parts[k]);
    }
    w.tuple_from_mark();
  }
  w.setitems_from_mark();
  w.str("storage_data");
  w.empty_dict();
  w.mark();
  for (const Written& it : items)
    for (size_t k = 0; k < it.pieces.size(); ++k) {
      const Piece& pc = it.pieces[k];
      new_object(w, kMeta, "MetadataIndex");
      w.empty_dict();
      w.mark();
      w.str("fqn");
      w.str(it.key);
      w.str("offset");
      if (it.tensor) write_size(w, pc.offsets);
      else w.none();
      w.str("index");
      if (it.tensor) w.integer(static_cast<int64_t>(k));
      else w.none();
      w.setitems_from_mark();
      w.build();
      new_object(w, "torch.distributed.checkpoint.filesystem", "_StorageInfo");
      w.empty_dict();
      w.mark();
      w.str("relative_path");
      w.str(data_file(pc.file));
      w.str("offset");
      w.integer(static_cast<int64_t>(pc.offset));
      w.str("length");
      w.integer(static_cast<int64_t>(pc.length));
      w.str("transform_descriptors");
      if (pc.transforms.empty()) {
        w.none();
      } else {
        w.empty_list();
        w.mark();
        for (const std::string& t : pc.transforms) w.str(t);
        w.appends_from_mark();
      }
      w.setitems_from_mark();
      w.build();
    }
  w.setitems_from_mark();
  w.str("storage_meta");
  w.none();
  w.str("version");
  w.str("1.0.0");
  w.setitems_from_mark();
  w.build();
  return w.finish();
}

PlannerPath dict_path(std::vector<std::string> parts) {
  std::vector<bool> index(parts.size(), false);
  return {std::move(parts), std::move(index)};
}

}  // namespace

std::string SourceLayout::optimizer_key() const {
  std::string s;
  for (const std::string& part : optimizer_path) s += (s.empty() ? "" : ".") + part;
  return s;
}

namespace {

std::vector<std::string> joined(std::vector<std::string> head, std::initializer_list<std::string> tail) {
  head.insert(head.end(), tail);
  return head;
}

// Copies the source's items that the state does not hold, each a torch.save archive checked whole
// (end records, central directory) before it is copied: a damaged one fails the write, naming it,
// rather than landing in a checkpoint that looks valid. Source data files are spread over the
// output files in name order, so a many-rank source keeps its bytes in many files.
Status copy_carried(const SourceLayout& src, std::vector<OutputFile>& outs, const std::set<std::string>& written,
                    std::vector<Written>& done) {
  std::map<std::string, size_t> out_of;  // source data file -> output file
  for (const CarriedItem& c : src.carried)
    for (const StorageLoc& loc : c.pieces) out_of.emplace(loc.relative_path, 0);
  size_t n = 0;
  for (auto& [rel, o] : out_of) o = n++ % outs.size();
  std::map<std::string, InputFile> files;
  std::vector<std::byte> buf;
  for (const CarriedItem& c : src.carried) {
    if (written.count(c.name.key)) continue;  // the state's value replaces the source's (e.g. `foreach`)
    Written wr{c.name.key, c.name.path, c.meta.is_tensor, c.meta.dtype, c.meta.size, {}};
    for (size_t k = 0; k < c.pieces.size(); ++k) {
      const StorageLoc& loc = c.pieces[k];
      const std::string iw = fmt::format("{}: item '{}'{}", src.dir.string(), c.name.key,
                                         c.meta.is_tensor ? " chunk at " + format_shape(c.meta.chunks[k].offsets) : "");
      auto f = files.find(loc.relative_path);
      if (f == files.end()) {
        OPTSTATE_ASSIGN_OR_RETURN(fs::path full, contained_path(src.dir, loc.relative_path));
        auto in = InputFile::open(full);
        if (!in.ok()) return Status(in.status().code(), fmt::format("{}: data file {}", iw, in.status().message()));
        f = files.emplace(loc.relative_path, std::move(*in)).first;
      }
      const InputFile& in = f->second;
      if (loc.offset > in.size() || loc.length > in.size() - loc.offset)
        return corrupt(fmt::format("{}: bytes [{}, {}) lie beyond the end of {}", iw, loc.offset,
                                   loc.offset + loc.length, in.path().string()));
      if (loc.transforms.empty()) {
        OPTSTATE_RETURN_IF_ERROR(read_archive_index(in, loc, iw).status());
      } else {
        // Checked decoded, then copied as stored (still compressed), its descriptors with it.
        const ChunkMeta* chunk = c.meta.is_tensor ? &c.meta.chunks[k] : nullptr;
        OPTSTATE_ASSIGN_OR_RETURN(InputFile decoded, decoded_item(in, loc, stored_bytes_cap(c.meta, chunk),
                                                                  stored_bytes_hint(c.meta, chunk), iw));
        OPTSTATE_RETURN_IF_ERROR(
            read_archive_index(decoded, StorageLoc{loc.relative_path, 0, decoded.size(), {}, std::nullopt}, iw).status());
      }
      OutputFile& out = outs[out_of.at(loc.relative_path)];
      Piece pc;
      pc.transforms = loc.transforms;
      pc.file = static_cast<int>(out_of.at(loc.relative_path));
      pc.offset = out.offset();
      pc.length = loc.length;
      if (c.meta.is_tensor) {
        pc.offsets = c.meta.chunks[k].offsets;
        pc.sizes = c.meta.chunks[k].sizes;
      }
      for (uint64_t at = 0; at < loc.length;) {
        buf.resize(std::min<uint64_t>(loc.length - at, kStreamPieceBytes));
        OPTSTATE_RETURN_IF_ERROR(in.read_at(loc.offset + at, buf).with_context(iw));
        OPTSTATE_RETURN_IF_ERROR(out.write(buf));
        at += buf.size();
      }
      wr.pieces.push_back(std::move(pc));
    }
    done.push_back(std::move(wr));
  }
  return Status::Ok();
}

// Tensors are laid out as `world` ranks' row shards (torch.chunk of dim 0, as FSDP2), each rank's
// chunks in its own file; bytes items and 0-d tensors go to rank 0's. The names follow `layout`;
// `flags`: the source's AdamW switches by group (CheckpointReader::adamw_flags); `extras` its other
// plain group keys (CheckpointReader::group_extras).
Status write_into(StateSource& source, const fs::path& staging, int world, const SourceLayout& layout,
                  bool carry, bool float_lr, bool torchao, std::string_view torchao_package,
                  std::span<const AdamWFlags> flags, std::span<const GroupExtras> extras,
                  const CheckpointReader* model_from) {
  const OptimizerState& state = source.meta();
  std::vector<OutputFile> outs;
  for (int r = 0; r < world; ++r) {
    auto f = OutputFile::create(staging / data_file(r));
    if (!f.ok() && r > 0)  // most likely the limit on open files (ulimit -n)
      return f.status().with_context(fmt::format("a DCP write keeps its {} ranks' files open at once", world));
    if (!f.ok()) return f.status();
    outs.push_back(std::move(*f));
  }
  std::vector<Written> done;
  auto value_item = [&](ItemName name, std::string pkl) -> Status {
    Written wr{std::move(name.key), std::move(name.path), false, DType::kF32, {}, {}};
    Piece pc;
    pc.offset = outs[0].offset();
    OPTSTATE_ASSIGN_OR_RETURN(pc.length, Item(std::move(pkl)).write(outs[0], {}, false));
    wr.pieces.push_back(pc);
    done.push_back(std::move(wr));
    return Status::Ok();
  };
  auto tensor_item = [&](ItemName name, DType d, const std::vector<int64_t>& shape,
                         std::span<const std::byte> bytes) -> Status {
    Written wr{std::move(name.key), std::move(name.path), true, d, shape, {}};
    Entry dense;
    dense.dtype = d;
    const int ranks = shape.empty() ? 1 : world;
    int64_t row = 1;
    for (size_t k = 1; k < shape.size(); ++k) row *= shape[k];
    for (int r = 0; r < ranks; ++r) {
      const FlatRange fr = shape.empty() ? FlatRange{0, 1} : shard_range(dense, Component::kValues, shape, world, r);
      if (fr.size() == 0 && !wr.pieces.empty()) continue;  // trailing ranks without rows (an empty tensor keeps one chunk)
      Piece pc;
      pc.file = r;
      pc.offsets.assign(shape.size(), 0);
      pc.sizes = shape;
      if (!shape.empty()) {
        pc.offsets[0] = row ? fr.begin / row : 0;
        pc.sizes[0] = row ? fr.size() / row : shape[0];
      }
      std::vector<int64_t> chunk_shape = pc.sizes;
      const size_t elem = dtype_size(d);
      pc.offset = outs[static_cast<size_t>(r)].offset();
      OPTSTATE_ASSIGN_OR_RETURN(
          pc.length, Item(tensor_pickle(d, chunk_shape))
                         .write(outs[static_cast<size_t>(r)],
                                bytes.subspan(static_cast<size_t>(fr.begin) * elem, static_cast<size_t>(fr.size()) * elem),
                                true));
      wr.pieces.push_back(std::move(pc));
    }
    done.push_back(std::move(wr));
    return Status::Ok();
  };
  // A blockwise8 entry as torchao's OptimState8bit items, one per rank's rows (fits_torchao_items):
  // codes, the rows' scales and the map, as torch.save pickles the subclass; the metadata claims the
  // subclass's dtype (the param's), as torchao's own save does.
  auto torchao_item = [&](ItemName name, const Entry& e, const ParamState& ps, bool is_signed) -> Status {
    const DType apparent = ps.param_dtype == DType::kBF16 || ps.param_dtype == DType::kF16 ? ps.param_dtype : DType::kF32;
    OPTSTATE_ASSIGN_OR_RETURN(const QMap m, qmap_from_name(e.qmap));
    const auto qmap = std::as_bytes(std::span(qmap_table(m)));
    Written wr{std::move(name.key), std::move(name.path), true, apparent, ps.shape, {}};
    Entry dense;
    dense.dtype = DType::kF32;
    int64_t row = 1;
    for (size_t d = 1; d < ps.shape.size(); ++d) row *= ps.shape[d];
    for (int r = 0; r < world; ++r) {
      const FlatRange fr = shard_range(dense, Component::kValues, ps.shape, world, r);
      if (fr.size() == 0) continue;  // fits_torchao_items: the tensor is not empty
      Piece pc;
      pc.file = r;
      pc.offsets.assign(ps.shape.size(), 0);
      pc.sizes = ps.shape;
      pc.offsets[0] = fr.begin / row;
      pc.sizes[0] = fr.size() / row;
      pickle::Writer w;
      torchao::encode_optim_state_8bit(w, pc.sizes, apparent, e.block_size, is_signed, "0", "1", "2", torchao_package);
      const std::string pkl = w.finish();
      OutputFile& out = outs[static_cast<size_t>(r)];
      pc.offset = out.offset();
      ArchiveWriter archive(out);
      OPTSTATE_RETURN_IF_ERROR(archive.begin(std::as_bytes(std::span(pkl))));
      OPTSTATE_RETURN_IF_ERROR(archive.storage("0", e.codes.span().subspan(static_cast<size_t>(fr.begin),
                                                                            static_cast<size_t>(fr.size()))));
      OPTSTATE_RETURN_IF_ERROR(archive.storage(
          "1", e.absmax.span().subspan(static_cast<size_t>(fr.begin / e.block_size) * 4,
                                       static_cast<size_t>(fr.size() / e.block_size) * 4)));
      OPTSTATE_RETURN_IF_ERROR(archive.storage("2", qmap));
      OPTSTATE_ASSIGN_OR_RETURN(pc.length, archive.finish());
      wr.pieces.push_back(std::move(pc));
    }
    done.push_back(std::move(wr));
    return Status::Ok();
  };
  if (torchao)  // its loader would drop the flag and step the other way
    for (size_t g = 0; g < state.groups.size(); ++g)
      if (state.groups[g].hyper.maximize)
        return invalid_argument(fmt::format("param group {}: maximize; torchao's AdamW8bit has none (write "
                                            "torch.optim.AdamW's state: --to fp32)", g));
  const std::string k = layout.optimizer_key();
  const std::string kd = k.empty() ? "" : k + ".";  // item keys under K ("" where K is the whole state dict)
  const std::vector<std::string>& kp = layout.optimizer_path;
  std::set<std::string> replaced;  // carried items written in another form (float_lr)
  std::set<std::string> source_keys;  // a DCP source's items that this write carries
  if (carry)
    for (const CarriedItem& c : layout.carried) source_keys.insert(c.name.key);
  // A numbered source's state is written numbered again (SourceLayout::numbered): params that kept
  // their numbers (nothing named them) keep them, and each group lists the source's numbers again
  // (a param without state, which the state cannot hold, too); named ones are numbered by their
  // place in the groups' order, as optimizer.state_dict() numbers them (every param is listed: the
  // model gave each its weights).
  const bool numbered = layout.numbered && !layout.flattened;
  std::map<std::string, int64_t> number_of;
  const std::vector<std::vector<int64_t>>* members = nullptr;  // the source's groups, where written again
  if (numbered) {
    bool kept_numbers = layout.numbers_kept;
    std::map<std::string, int64_t> kept;  // each name's own number, where names are numbers
    for (const ParamGroup& pg : state.groups)
      for (const std::string& fqn : pg.params) {
        int64_t n = -1;
        const auto [end, ec] = std::from_chars(fqn.data(), fqn.data() + fqn.size(), n);
        kept_numbers = kept_numbers && ec == std::errc() && end == fqn.data() + fqn.size() && n >= 0;
        kept.emplace(fqn, n);
        number_of.emplace(fqn, static_cast<int64_t>(number_of.size()));
      }
    if (kept_numbers) number_of = std::move(kept);
    // Kept numbers: each group lists the source's members again where it holds the same params
    // (those without state included); not where the groups changed.
    if (kept_numbers && layout.numbered_members.size() == state.groups.size()) {
      bool same = true;
      for (size_t g = 0; g < state.groups.size() && same; ++g) {
        const auto& was = layout.numbered_members[g];
        for (const std::string& fqn : state.groups[g].params)
          same = same && std::find(was.begin(), was.end(), number_of.at(fqn)) != was.end();
      }
      if (same) members = &layout.numbered_members;
    }
  }
  // `<K>.state.<fqn>.<entry>`: nested paths (K, "state", fqn, entry) or flattened (K, "state.<fqn>.<entry>");
  // numbered, `<K>.state.<n>.<entry>`, n a string in the planner's path as torch's flattening keeps
  // every dict key (list indices stay ints).
  auto state_name = [&](const std::string& fqn, const std::string& entry) {
    const std::string n = numbered ? std::to_string(number_of.at(fqn)) : fqn;
    return ItemName{fmt::format("{}state.{}.{}", kd, n, entry),
                    layout.flattened ? dict_path(joined(kp, {fmt::format("state.{}.{}", n, entry)}))
                                     : dict_path(joined(kp, {"state", n, entry}))};
  };
  // Bytes items first, as DCP writes them: the param groups' fields, per group (nested:
  // `<K>.param_groups.<i>.<field>` and the members in `params`) or per param (flattened:
  // `<K>.param_groups.<fqn>.<field>`, each param carrying its group's fields).
  for (size_t g = 0; g < state.groups.size(); ++g) {
    const Hyperparameters& h = state.groups[g].hyper;
    const std::vector<std::string> nested_owner{""};
    const std::vector<std::string>& owners = layout.flattened ? state.groups[g].params : nested_owner;
    for (const std::string& fqn : owners) {
      auto name = [&](const char* field) {
        if (layout.flattened)
          return ItemName{fmt::format("{}param_groups.{}.{}", kd, fqn, field),
                          dict_path(joined(kp, {fmt::format("param_groups.{}.{}", fqn, field)}))};
        PlannerPath p = dict_path(joined(kp, {"param_groups", std::to_string(g), field}));
        p.index[kp.size() + 1] = true;
        return ItemName{fmt::format("{}param_groups.{}.{}", kd, g, field), std::move(p)};
      };
      auto num = [&](const char* field, double v) {
        pickle::Writer w;
        w.real(v);
        return value_item(name(field), w.finish());
      };
      auto flag = [&](const char* field, FlagValue v) {
        pickle::Writer w;
        encode_flag(w, v);
        return value_item(name(field), w.finish());
      };
      // lr as the source kept it: a 0-d tensor where torchao's groups (and torch's with a tensor lr) hold one.
      const bool lr_tensor = float_lr  ? false
                             : torchao ? true  // torchao's step refuses a float lr
                             : layout.flattened ? layout.tensor_lr.count(fqn) > 0
                                              : std::any_of(state.groups[g].params.begin(), state.groups[g].params.end(),
                                                            [&](const std::string& f) { return layout.tensor_lr.count(f); });
      if (lr_tensor) {
        const float lr = static_cast<float>(h.lr);
        OPTSTATE_RETURN_IF_ERROR(tensor_item(name("lr"), DType::kF32, {}, std::as_bytes(std::span(&lr, 1))));
      } else {
        OPTSTATE_RETURN_IF_ERROR(num("lr", h.lr));
      }
      {
        pickle::Writer w;
        w.mark();
        w.real(h.beta1);
        w.real(h.beta2);
        w.tuple_from_mark();
        OPTSTATE_RETURN_IF_ERROR(value_item(name("betas"), w.finish()));
      }
      OPTSTATE_RETURN_IF_ERROR(num("eps", h.eps));
      if (layout.decoupled_decay.empty()) {
        OPTSTATE_RETURN_IF_ERROR(num("weight_decay", h.weight_decay));
      } else {
        // Composer's DecoupledAdamW's own, in its layout: the file's where the group's is the one
        // read from it, else AdamW's times initial_lr.
        if (layout.decoupled_decay.size() != state.groups.size())
          return invalid_argument(fmt::format("{} param groups to write as Composer's DecoupledAdamW's, whose {} "
                                              "groups were read", state.groups.size(), layout.decoupled_decay.size()));
        const SourceLayout::DecoupledDecay& d = layout.decoupled_decay[g];
        if (h.weight_decay != d.read && !(d.initial_lr > 0))
          return invalid_argument(fmt::format("param group {}: weight_decay {} cannot be Composer's DecoupledAdamW's: "
                                              "the group has no positive initial_lr", g, h.weight_decay));
        OPTSTATE_RETURN_IF_ERROR(num("weight_decay", h.weight_decay == d.read ? d.saved : h.weight_decay * d.initial_lr));
      }
      auto boolean = [](bool b) { return b ? FlagValue::kTrue : FlagValue::kFalse; };
      OPTSTATE_RETURN_IF_ERROR(flag("amsgrad", boolean(h.amsgrad)));
      OPTSTATE_RETURN_IF_ERROR(flag("maximize", boolean(h.maximize)));
      // The rest of torch.optim.AdamW's group (2.13), so dcp.load finds every key it asks for; the
      // source's switches where it kept them (a DCP source's items carried as they were; fused=True
      // stays fused: torch's load_state_dict takes the group as saved), else torch's defaults.
      const AdamWFlags* kept = source_flags(flags, state.groups.size(), g);
      for (const auto& [field, fallback] : kAdamWFlagDefaults) {
        const std::string f(field);
        if (!source_keys.count(name(f.c_str()).key))
          OPTSTATE_RETURN_IF_ERROR(flag(f.c_str(), written_flag(kept, field, fallback)));
      }
      // The source's other plain keys (a scheduler's initial_lr, a layer's lr_scale; a DCP source's
      // items are carried as they were): a one-element tensor as a tensor where lr is one, else as
      // a float, as lr is written.
      if (const GroupExtras* more = source_extras(extras, state.groups.size(), g))
        for (const auto& [field, v] : *more) {
          const ItemName item = name(field.c_str());
          if (source_keys.count(item.key)) continue;
          if (v.kind == GroupValue::Kind::kTensor && lr_tensor) {
            const float f = static_cast<float>(v.f);
            OPTSTATE_RETURN_IF_ERROR(tensor_item(item, DType::kF32, v.shape, std::as_bytes(std::span(&f, 1))));
          } else {
            pickle::Writer w;
            encode_group_value(w, v);
            OPTSTATE_RETURN_IF_ERROR(value_item(item, w.finish()));
          }
        }
      if (layout.flattened) continue;
      pickle::Writer w;
      w.empty_list();
      w.mark();
      if (members)
        for (int64_t member : (*members)[g]) w.integer(member);
      else
        for (const std::string& member : state.groups[g].params)
          if (numbered)
            w.integer(number_of.at(member));
          else
            w.str(member);
      w.appends_from_mark();
      OPTSTATE_RETURN_IF_ERROR(value_item(name("params"), w.finish()));
    }
  }
  for (const auto& [fqn, ps] : state.params) {
    OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(ps.shape));
    for (const auto& [name, me] : ps.entries) {
      OPTSTATE_ASSIGN_OR_RETURN(const Entry e, source.load(fqn, name));
      std::vector<float> dq;
      std::span<const std::byte> bytes = e.values.span();
      DType d = e.dtype;
      if (e.encoding == Encoding::kBlockwise8 && torchao && fits_torchao_items(name, e, ps.shape, world)) {
        OPTSTATE_RETURN_IF_ERROR(torchao_item(state_name(fqn, name), e, ps, name == kExpAvg));
        continue;
      }
      if (e.encoding == Encoding::kBlockwise8) {
        OPTSTATE_ASSIGN_OR_RETURN(QMap m, qmap_from_name(e.qmap));
        dq.resize(static_cast<size_t>(numel));
        dequantize_blockwise({reinterpret_cast<const uint8_t*>(e.codes.data), e.codes.size},
                             {reinterpret_cast<const float*>(e.absmax.data), e.absmax.size / 4}, e.block_size, m, dq);
        bytes = std::as_bytes(std::span(dq));
        d = DType::kF32;
      }
      if (name == kParam) {
        auto w = layout.weights.find(fqn);
        std::string model_key;
        for (const std::string& part : layout.model_parent()) model_key += part + ".";
        ItemName where = w != layout.weights.end()
                             ? w->second
                             : ItemName{model_key + "model." + fqn, dict_path(joined(layout.model_parent(), {"model", fqn}))};
        OPTSTATE_RETURN_IF_ERROR(tensor_item(std::move(where), d, ps.shape, bytes));
      } else {
        OPTSTATE_RETURN_IF_ERROR(tensor_item(state_name(fqn, name), d, ps.shape, bytes));
      }
    }
    if (ps.entries.count(kExpAvg)) {
      // torch.optim.AdamW keeps the step as a float32 tensor: exact up to 2^24 (where its own
      // counter stops); a larger one would be rounded, so it is refused instead.
      if (ps.step > (int64_t{1} << 24))
        return invalid_argument(fmt::format("param '{}': step {} is beyond what torch.optim.AdamW's float32 step "
                                            "holds exactly (2^24)", fqn, ps.step));
      const float step = static_cast<float>(ps.step);
      OPTSTATE_RETURN_IF_ERROR(tensor_item(state_name(fqn, "step"), DType::kF32, {}, std::as_bytes(std::span(&step, 1))));
    }
  }
  // The model's other tensors beside the optimizer (a torch.save file's buffers, tied names,
  // frozen params: CheckpointReader::model_tensors) as `model.<name>` items beside the weights, as
  // get_state_dict(model) saves them: a strict dcp.load of the model's state dict finds them all.
  if (model_from) {
    std::string model_key;
    for (const std::string& part : layout.model_parent()) model_key += part + ".";
    const std::span<const ModelTensorInfo> tensors = model_from->model_tensors();
    for (size_t i = 0; i < tensors.size(); ++i) {
      const ModelTensorInfo& t = tensors[i];
      OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(t.shape));
      std::vector<std::byte> bytes;
      bytes.reserve(static_cast<size_t>(numel) * dtype_size(t.dtype));
      OPTSTATE_RETURN_IF_ERROR(stream_model_tensor_exactly(*model_from, i, [&](std::span<const std::byte> piece) {
        bytes.insert(bytes.end(), piece.begin(), piece.end());
        return Status::Ok();
      }));
      OPTSTATE_RETURN_IF_ERROR(tensor_item(ItemName{model_key + "model." + t.name,
                                                    dict_path(joined(layout.model_parent(), {"model", t.name}))},
                                           t.dtype, t.shape, bytes));
    }
  }
  if (carry && float_lr) {
    // What the source kept as 0-d tensors because its lr was one (torchao): the group fields
    // (initial_lr) become numbers, an LR scheduler's lists of them (base_lrs, _last_lr: items
    // `<top>.<name>.<i>`) one list of numbers, as torch keeps them for a float lr.
    std::map<std::vector<std::string>, std::map<int64_t, const CarriedItem*>> lists;  // list path -> elements
    std::set<std::string> carried_keys;
    for (const CarriedItem& c : layout.carried) carried_keys.insert(c.name.key);
    for (const CarriedItem& c : layout.carried) {
      if (!c.meta.is_tensor || !c.meta.size.empty() || !c.name.path) continue;
      const PlannerPath& p = *c.name.path;
      const size_t n = p.parts.size(), d = kp.size();
      const bool under_optimizer = n > d && std::equal(kp.begin(), kp.end(), p.parts.begin());
      const bool group_field = under_optimizer && ((n == d + 1 && p.parts[d].rfind("param_groups.", 0) == 0) ||
                                                   (n == d + 3 && p.parts[d] == "param_groups"));
      if (group_field) {
        OPTSTATE_ASSIGN_OR_RETURN(const double v, layout.number(c.name.key));
        pickle::Writer w;
        w.real(v);
        OPTSTATE_RETURN_IF_ERROR(value_item(c.name, w.finish()));
      } else if (n >= 3 && !under_optimizer && p.index[n - 1] &&
                 (p.parts[n - 2] == "base_lrs" || p.parts[n - 2] == "_last_lr")) {
        lists[std::vector<std::string>(p.parts.begin(), p.parts.end() - 1)][std::stoll(p.parts[n - 1])] = &c;
      }
    }
    for (const auto& [owner, elems] : lists) {
      std::string key;
      for (const std::string& part : owner) key += (key.empty() ? "" : ".") + part;
      if (elems.begin()->first != 0 || elems.rbegin()->first != static_cast<int64_t>(elems.size()) - 1 ||
          carried_keys.count(key))
        continue;  // not a whole list of tensors: left as it is
      pickle::Writer w;
      w.empty_list();
      w.mark();
      for (const auto& [i, c] : elems) {
        OPTSTATE_ASSIGN_OR_RETURN(const double v, layout.number(c->name.key));
        w.real(v);
      }
      w.appends_from_mark();
      OPTSTATE_RETURN_IF_ERROR(value_item(ItemName{key, dict_path(owner)}, w.finish()));
      for (const auto& [i, c] : elems) replaced.insert(c->name.key);
    }
  }
  if (carry) {
    std::set<std::string> written = std::move(replaced);
    for (const Written& wr : done) written.insert(wr.key);
    OPTSTATE_RETURN_IF_ERROR(copy_carried(layout, outs, written, done));
  }
  if (numbered) {
    // The metadata lists the items in the source's order, which names numbered params when it is
    // read again: the model's tensors in module order (name_numbered places the params among them).
    std::map<std::string_view, size_t> at;
    for (const std::string& key : layout.item_order) at.emplace(key, at.size());
    auto place = [&](const Written& w) {
      const auto it = at.find(w.key);
      return it == at.end() ? at.size() : it->second;
    };
    std::stable_sort(done.begin(), done.end(), [&](const Written& a, const Written& b) { return place(a) < place(b); });
  }
  for (OutputFile& f : outs) OPTSTATE_RETURN_IF_ERROR(f.sync_and_close());
  const std::string md = metadata_pickle(done);
  if (md.size() > kMaxMetadataBytes)
    return invalid_argument(fmt::format(".metadata of {} items would be {} bytes, over the {} GiB it is read up to",
                                        done.size(), md.size(), kMaxMetadataBytes >> 30));
  return write_small_file(staging / ".metadata", std::as_bytes(std::span(md)));
}

}  // namespace

bool writes_torchao_items(const WriteOptions& options, const SourceLayout* source) {
  return !options.float_lr && (options.quantized || (source && source->torchao_8bit));
}

bool fits_torchao_items(const std::string& moment, const Entry& e, const std::vector<int64_t>& shape, int world) {
  const auto numel = checked_numel(shape);
  if (!numel.ok() || shape.empty() || !torchao::steps_as_8bit(moment, e, *numel)) return false;
  Entry dense;
  dense.dtype = DType::kF32;
  for (int r = 0; r < world; ++r) {
    const FlatRange fr = shard_range(dense, Component::kValues, shape, world, r);
    if (fr.begin % e.block_size || fr.size() % e.block_size) return false;
  }
  return true;
}

Status ArchiveWriter::put(const std::string& name, std::span<const std::byte> data) {
  const std::string h = zb_.local_header("archive/" + name, data.size(), zip::crc32(data), out_.offset() - start_);
  OPTSTATE_RETURN_IF_ERROR(out_.write(std::as_bytes(std::span(h))));
  return out_.write(data);
}

Status ArchiveWriter::begin(std::span<const std::byte> pkl) {
  auto text = [](const char* s) { return std::as_bytes(std::span(s, std::strlen(s))); };
  if (pkl.size() > kMaxArchivePickleBytes)
    return invalid_argument(fmt::format("a torch.save data.pkl of {} bytes, over the {} GiB it is read up to",
                                        pkl.size(), kMaxArchivePickleBytes >> 30));
  OPTSTATE_RETURN_IF_ERROR(put("data.pkl", pkl));
  OPTSTATE_RETURN_IF_ERROR(put(".format_version", text("1")));
  OPTSTATE_RETURN_IF_ERROR(put(".storage_alignment", text("64")));
  return put("byteorder", text("little"));
}

Status ArchiveWriter::storage(const std::string& key, std::span<const std::byte> bytes) { return put("data/" + key, bytes); }

Status ArchiveWriter::begin_storage(const std::string& key, uint64_t size) {
  if (streamed_) return internal_error("a streamed storage is still open");
  const uint64_t at = out_.offset();
  const std::string h = zb_.local_header("archive/data/" + key, size, 0, at - start_);
  OPTSTATE_RETURN_IF_ERROR(out_.write(std::as_bytes(std::span(h))));
  streamed_ = Streamed{at, size, 0};
  return Status::Ok();
}

Status ArchiveWriter::append(std::span<const std::byte> bytes) {
  if (!streamed_ || bytes.size() > streamed_->left) return internal_error("append past a streamed storage's size");
  streamed_->crc = zip::crc32(bytes, streamed_->crc);
  streamed_->left -= bytes.size();
  return out_.write(bytes);
}

Status ArchiveWriter::end_storage() {
  if (!streamed_ || streamed_->left != 0) return internal_error("a streamed storage ended short of its size");
  const uint32_t crc = streamed_->crc;
  const std::byte le[4] = {std::byte(crc & 0xff), std::byte((crc >> 8) & 0xff), std::byte((crc >> 16) & 0xff),
                           std::byte(crc >> 24)};
  OPTSTATE_RETURN_IF_ERROR(out_.patch(streamed_->header_at + zip::Builder::kLocalCrcOffset, le));
  zb_.set_last_crc(crc);
  streamed_.reset();
  return Status::Ok();
}

Result<uint64_t> ArchiveWriter::finish() {
  OPTSTATE_RETURN_IF_ERROR(put("version", std::as_bytes(std::span("3\n", 2))));
  const std::string tail = zb_.finish(out_.offset() - start_);
  OPTSTATE_RETURN_IF_ERROR(out_.write(std::as_bytes(std::span(tail))));
  return out_.offset() - start_;
}

Status write_dcp(StateSource& state, const fs::path& path, const WriteOptions& options,
                 const SourceLayout* source) {
  OPTSTATE_RETURN_IF_ERROR(check_structure(state.meta(), false));
  OPTSTATE_RETURN_IF_ERROR(check_destination(path, options.overwrite));
  if (options.world_size < 1 || options.world_size > 65536)
    return invalid_argument(fmt::format("world size {} out of range", options.world_size));
  OPTSTATE_ASSIGN_OR_RETURN(const std::string_view torchao_package, written_torchao_package(options));
  OPTSTATE_ASSIGN_OR_RETURN(Staging staging, Staging::directory(path));
  const SourceLayout get_state_dict_layout;  // {"model": ..., "optim": ...}, nested groups
  Status written = write_into(state, staging.path(), options.world_size, source ? *source : get_state_dict_layout,
                              source != nullptr, options.float_lr, writes_torchao_items(options, source), torchao_package,
                              options.source ? options.source->adamw_flags() : std::span<const AdamWFlags>{},
                              options.source ? options.source->group_extras() : std::span<const GroupExtras>{},
                              source ? nullptr : options.source);
  // What the source's folder held beside the DCP (Lightning's meta.pt), as it was.
  for (size_t i = 0; source && written.ok() && i < source->beside.size(); ++i)
    written = copy_entry_as_is(source->dir / source->beside[i], staging.path() / source->beside[i]);
  return staging.commit(written, options.overwrite);
}

}  // namespace optstate::dcp
