// The bitsandbytes driver: the optimizer state_dict of bitsandbytes' AdamW8bit / AdamW, as
// Hugging Face's Trainer saves it with optim="adamw_bnb_8bit" (checkpoint-N/optimizer.pt). Read
// through the torch.save driver (the same zip, pickle interpreter and tensor rebuilds; torchsave/,
// whose reader knows bitsandbytes' names), written here so that bitsandbytes' load_state_dict takes
// it and steps on. Layout: FORMAT.md.
#include "bnb_layout.h"
#include "dcp/dcp_driver.h"
#include "optstate/checkpoint.h"
#include "torchsave/torchsave_reader.h"

namespace optstate::bitsandbytes {

namespace fs = std::filesystem;

namespace {

class BitsandbytesDriver final : public FormatDriver {
 public:
  std::string_view name() const override { return "bitsandbytes"; }

  // A torch.save file (first record <folder>/data.pkl) whose pickle names "state1" and "state2".
  bool sniff(const fs::path& path) const override {
    return torchsave::is_torch_save_of(path, torchsave::Family::kBitsandbytes);
  }

  Result<std::unique_ptr<CheckpointReader>> open(const fs::path& path) const override {
    return torchsave::open_file(path);  // says "bitsandbytes" when it read bitsandbytes' state
  }

  OptimizerState kept(const OptimizerState& state) const override { return kept_state(state); }
  OptimizerState kept_by_write(const OptimizerState& state, const WriteOptions& options) const override {
    return torchsave::framed_read_back(kept_state(state), options);
  }

  // A training loop's own file ({"model", "optimizer", "epoch"}, Lightning's .ckpt): its other
  // entries go with the state (torchsave::write_carrying).
  bool keeps_group_extras() const override { return true; }
  // A file written from a DCP holds its buffers and tied names in the model dict (torchsave::write_framed).
  bool keeps_model_tensors() const override { return true; }
  bool carries(const CheckpointReader& source, const fs::path&) const override {
    return torchsave::carries_file(source);
  }

  // The nested form loads in bitsandbytes 0.49.2 and later only: said unless the source was such a file.
  std::vector<std::string> write_notes(const OptimizerState& kept, const WriteOptions& options) const override {
    std::vector<std::string> notes = torchsave::framed_read_back_notes(kept, options);
    const auto layout = written_layout(options);
    const bool from_nested = options.source && torchsave::bnb_nested(*options.source).value_or(false);
    if (!layout.ok() || *layout != Layout::kNested || from_nested || kept.params.empty()) return notes;
    notes.push_back("its state tensors are nested in '__bnb_optimizer_quant_state__', as bitsandbytes 0.49.2 and later "
                    "save and load them; for earlier releases: --bitsandbytes-layout flat");
    return notes;
  }

  Status write(StateSource& source, const fs::path& path, const WriteOptions& options) const override {
    OPTSTATE_ASSIGN_OR_RETURN(const Layout layout, written_layout(options));
    return torchsave::write_framed(source, path, options, [&](pickle::Writer& w, const torchsave::SpecSink& add,
                                                              const torchsave::FrameOptions& fo) {
      return plan_frame(source.meta(), w, add, fo, layout);
    });
  }
};

}  // namespace

const FormatDriver& driver() {
  static const BitsandbytesDriver d;
  return d;
}

}  // namespace optstate::bitsandbytes
