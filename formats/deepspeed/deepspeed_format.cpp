// The deepspeed driver: a DeepSpeed ZeRO checkpoint (stages 1, 2 and 3), as engine.save_checkpoint
// writes it and Hugging Face's Trainer keeps it under DeepSpeed (checkpoint-500/global_step500/):
// every data-parallel rank's partition of the flat fp32 param groups, their AdamW moments and the
// model states file that names the params. Read through the torch.save driver's reader (the same
// zip, pickle interpreter and tensor rebuilds; torchsave/), which puts each param together from the
// ranks' runs. Written from a DeepSpeed checkpoint, whose model states and optimizer settings it
// carries: of ZeRO-1/2, as a universal checkpoint (what ds_to_universal makes), which DeepSpeed loads
// on any number of ranks ("checkpoint": {"load_universal": true}); of ZeRO-3, as the ZeRO-3
// checkpoint of WriteOptions::world_size ranks (deepspeed_zero3.cpp). Layout: FORMAT.md.
#include <fmt/format.h>


#include "dcp/dcp_driver.h"
#include "dcp/dcp_layout.h"
#include "dcp/pickle.h"
#include "optstate/checkpoint.h"
#include "optstate/io.h"
#include "optstate/transform.h"
#include "registry.h"
#include "deepspeed_zero3.h"
#include "torchsave/torchsave_archive.h"
#include "torchsave/torchsave_layout.h"
#include "torchsave/torchsave_reader.h"

namespace optstate::deepspeed {

namespace fs = std::filesystem;

namespace {

constexpr uint64_t kCopyPieceBytes = uint64_t{8} << 20;

// A param's folder under zero/: its name as DeepSpeed names it, which must be one path component.
Status check_param_folder(const std::string& fqn) {
  if (fqn.empty() || fqn == "." || fqn == ".." || fqn.find('/') != std::string::npos ||
      fqn.find('\0') != std::string::npos || fqn.find('\\') != std::string::npos)
    return invalid_argument(fmt::format("param '{}': not usable as a folder name of a universal checkpoint", fqn));
  return Status::Ok();
}

Status copy_durably(const fs::path& from, const fs::path& to) {
  OPTSTATE_ASSIGN_OR_RETURN(InputFile in, InputFile::open(from));
  OPTSTATE_ASSIGN_OR_RETURN(OutputFile out, OutputFile::create(to));
  std::vector<std::byte> buf;
  for (uint64_t at = 0; at < in.size();) {
    buf.resize(std::min<uint64_t>(in.size() - at, kCopyPieceBytes));
    OPTSTATE_RETURN_IF_ERROR(in.read_at(at, buf));
    OPTSTATE_RETURN_IF_ERROR(out.write(buf));
    at += buf.size();
  }
  return out.sync_and_close();
}

// What a per-param file of ds_to_universal's holds: torch.save({"cat_dim": 0, "param": tensor}) of
// a param's state, {"param": tensor} of a module tensor without one, or the 0-d tensor alone (step.pt).
enum class FileForm { kCatDim, kParamOnly, kBare };

Status write_tensor_file(const fs::path& path, const std::vector<int64_t>& shape, std::span<const float> values,
                         FileForm form) {
  pickle::Writer w;
  if (form != FileForm::kBare) {
    w.empty_dict();
    w.mark();
    if (form == FileForm::kCatDim) {
      w.str("cat_dim");
      w.integer(0);
    }
    w.str("param");
  }
  dcp::encode_tensor(w, DType::kF32, shape, "0");
  if (form != FileForm::kBare) w.setitems_from_mark();
  const std::string pkl = w.finish();
  return torchsave::write_archive(path, pkl,
                                  [&](dcp::ArchiveWriter& archive) { return archive.storage("0", std::as_bytes(values)); });
}

Status make_folder(const fs::path& dir) {
  std::error_code ec;
  fs::create_directory(dir, ec);
  if (ec) return io_error(fmt::format("{}: {}", dir.string(), ec.message()));
  return Status::Ok();
}

Status write_universal(StateSource& source, const fs::path& staging, const torchsave::ZeroUniversalParts& parts) {
  const OptimizerState& state = source.meta();
  std::vector<float> scratch;  // 8-bit or half-precision entries widened (fp32 ones are written as loaded)
  for (const fs::path& model_states : parts.stage_model_states)
    OPTSTATE_RETURN_IF_ERROR(copy_durably(model_states, staging / model_states.filename()));
  OPTSTATE_RETURN_IF_ERROR(make_folder(staging / "zero"));
  OPTSTATE_RETURN_IF_ERROR(torchsave::write_archive(staging / "zero" / "optimizer_state.pt", parts.optimizer_state_pkl,
                                         [](dcp::ArchiveWriter&) { return Status::Ok(); }));
  for (const auto& [fqn, ps] : state.params) {
    OPTSTATE_RETURN_IF_ERROR(check_param_folder(fqn));
    const fs::path dir = staging / "zero" / fqn;
    OPTSTATE_RETURN_IF_ERROR(make_folder(dir));
    OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(ps.shape));
    // A param the optimizer never stepped has no state to merge: ds_to_universal writes its fp32.pt
    // as a module tensor's, without cat_dim (the values are the same: the fp32 weights are still the
    // half-precision ones widened).
    const FileForm form =
        ps.entries.count(kExpAvg) && !parts.affine_params.count(fqn) ? FileForm::kCatDim : FileForm::kParamOnly;
    for (const auto& [name, meta] : ps.entries) {
      OPTSTATE_ASSIGN_OR_RETURN(const Entry e, source.load(fqn, name));
      // fp32 values: DeepSpeed's master weights and moments are float32 (8-bit ones dequantized)
      OPTSTATE_ASSIGN_OR_RETURN(const std::span<const float> values, entry_f32_span(e, numel, entry_key(fqn, name), scratch));
      const std::string file = name == kParam ? "fp32" : name;
      OPTSTATE_RETURN_IF_ERROR(write_tensor_file(dir / (file + ".pt"), ps.shape, values, form));
    }
    if (ps.entries.count(kExpAvg) && parts.int_step) {  // DeepSpeed's CPU Adam: torch.save(step) of an int
      pickle::Writer w;
      w.integer(ps.step);
      OPTSTATE_RETURN_IF_ERROR(torchsave::write_archive(dir / "step.pt", w.finish(),
                                                        [](dcp::ArchiveWriter&) { return Status::Ok(); }));
    } else if (ps.entries.count(kExpAvg)) {
      const float step = static_cast<float>(ps.step);
      if (static_cast<int64_t>(step) != ps.step)
        return invalid_argument(fmt::format("param '{}': step {} is beyond what DeepSpeed's float32 step holds exactly",
                                            fqn, ps.step));
      OPTSTATE_RETURN_IF_ERROR(write_tensor_file(dir / "step.pt", {}, std::span(&step, 1), FileForm::kBare));
    }
    OPTSTATE_RETURN_IF_ERROR(fsync_directory(dir));
  }
  // Frozen params and buffers: their module values, as ds_to_universal writes them (DeepSpeed itself
  // loads them from the model states file; other readers of the layout look here).
  for (size_t i = 0; i < parts.module_only.size(); ++i) {
    const auto& [name, shape] = parts.module_only[i];
    if (state.params.count(name)) continue;
    OPTSTATE_RETURN_IF_ERROR(check_param_folder(name));
    const fs::path dir = staging / "zero" / name;
    OPTSTATE_RETURN_IF_ERROR(make_folder(dir));
    OPTSTATE_ASSIGN_OR_RETURN(const std::vector<float> values, parts.module_values(i));
    OPTSTATE_RETURN_IF_ERROR(write_tensor_file(dir / "fp32.pt", shape, values, FileForm::kParamOnly));
    OPTSTATE_RETURN_IF_ERROR(fsync_directory(dir));
  }
  OPTSTATE_RETURN_IF_ERROR(fsync_directory(staging / "zero"));
  return fsync_directory(staging);
}

// The ZeRO stage of the checkpoint at `path` (its rank 0's optimizer file); a universal checkpoint's
// is taken as 2 (zero_universal_parts refuses it, naming why).
Result<int> zero_stage(const fs::path& path) {
  const auto z = torchsave::zero_files(path);
  if (!z.ok() || !*z) return 2;  // no ZeRO files (a universal checkpoint): zero_universal_parts names why
  const auto& files = **z;
  OPTSTATE_ASSIGN_OR_RETURN(auto opened, torchsave::open_archive(files.optim().at(0)));
  OPTSTATE_ASSIGN_OR_RETURN(const torchsave::ZeroRank zr,
                            torchsave::interpret_zero_optim(opened.second, files.optim()[0].string()));
  return zr.stage;
}

class DeepSpeedDriver final : public FormatDriver {
 public:
  std::string_view name() const override { return "deepspeed"; }

  // A folder holding zero_pp_rank_*_mp_rank_*_optim_states.pt, or one whose `latest` names such a folder.
  bool sniff(const fs::path& path) const override { return torchsave::is_deepspeed_checkpoint(path); }

  Result<std::unique_ptr<CheckpointReader>> open(const fs::path& path) const override {
    return torchsave::open_deepspeed(path);
  }

  // DeepSpeed keeps fp32 moments.
  bool keeps_blockwise8() const override { return false; }
  // A ZeRO-3 checkpoint is written for --world-size ranks; a universal one loads on any.
  bool shards() const override { return true; }
  // Only from a DeepSpeed checkpoint (the files it carries): not from any state.
  bool writes() const override { return false; }

  Status write(StateSource& source, const fs::path& path, const WriteOptions& options) const override {
    if (!options.source || options.source->format() != "deepspeed")
      return invalid_argument(fmt::format(
          "{}: a DeepSpeed universal checkpoint is written from a DeepSpeed ZeRO checkpoint (it carries that run's "
          "model states file and optimizer settings); the source is {}", path.string(),
          options.source ? fmt::format("{} ({})", options.source->path().string(), options.source->format())
                         : std::string("a state in memory")));
    OPTSTATE_ASSIGN_OR_RETURN(const int stage, zero_stage(options.source->path()));
    std::optional<torchsave::ZeroUniversalParts> parts;
    if (stage != 3) {
      OPTSTATE_ASSIGN_OR_RETURN(parts, torchsave::zero_universal_parts(options.source->path()));
      if (options.world_size != 1)
        return invalid_argument(fmt::format("{}: --world-size {}: the universal checkpoint of a ZeRO-1/2 checkpoint "
                                            "loads on any world size (only a ZeRO-3 one is written for N ranks)",
                                            path.string(), options.world_size));
    }
    OPTSTATE_RETURN_IF_ERROR(check_structure(source.meta(), false));
    OPTSTATE_RETURN_IF_ERROR(check_destination(path, options.overwrite));
    OPTSTATE_ASSIGN_OR_RETURN(Staging staging, Staging::directory(path));
    return staging.commit(parts ? write_universal(source, staging.path(), *parts)
                                : write_zero3(source, options.source->path(), staging.path(), options.world_size),
                          options.overwrite);
  }

  // The model states file (module, frozen params, LR scheduler) and the optimizer's settings go
  // through as they were; the module's other tensors as fp32.pt too.
  bool carries(const CheckpointReader& source, const fs::path&) const override { return source.format() == "deepspeed"; }

  // Not a checkpoint optstate wrote: never replaced by an overwrite.
  bool replaceable(const fs::path&) const override { return false; }
};

}  // namespace

const FormatDriver& driver() {
  static const DeepSpeedDriver d;
  return d;
}

}  // namespace optstate::deepspeed
