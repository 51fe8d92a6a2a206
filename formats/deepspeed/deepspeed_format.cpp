// The deepspeed driver: a DeepSpeed ZeRO checkpoint (stages 1, 2 and 3), as engine.save_checkpoint
// writes it and Hugging Face's Trainer keeps it under DeepSpeed (checkpoint-500/global_step500/):
// every data-parallel rank's partition of the flat fp32 param groups, their AdamW moments and the
// model states file that names the params. Read through the torch.save driver's reader (the same
// zip, pickle interpreter and tensor rebuilds; torchsave/), which puts each param together from the
// ranks' runs; not written (DeepSpeed resumes its own, and `convert` writes the state in any other
// format or world size). Layout: FORMAT.md.
#include <fmt/format.h>

#include "optstate/checkpoint.h"
#include "torchsave/torchsave_reader.h"

namespace optstate::deepspeed {

namespace fs = std::filesystem;

namespace {

class DeepSpeedDriver final : public FormatDriver {
 public:
  std::string_view name() const override { return "deepspeed"; }

  // A folder holding zero_pp_rank_*_mp_rank_*_optim_states.pt, or one whose `latest` names such a folder.
  bool sniff(const fs::path& path) const override { return torchsave::is_deepspeed_checkpoint(path); }

  Result<std::unique_ptr<CheckpointReader>> open(const fs::path& path) const override {
    return torchsave::open_deepspeed(path);
  }

  bool writes() const override { return false; }

  Status write(StateSource&, const fs::path& path, const WriteOptions&) const override {
    return invalid_argument(fmt::format("{}: optstate reads DeepSpeed ZeRO checkpoints and does not write them; "
                                        "convert to another format", path.string()));
  }

  // Not a checkpoint optstate wrote: never replaced by an overwrite.
  bool replaceable(const fs::path&) const override { return false; }
};

}  // namespace

const FormatDriver& driver() {
  static const DeepSpeedDriver d;
  return d;
}

}  // namespace optstate::deepspeed
