// The torchao driver: the optimizer state_dict of torchao's AdamW8bit, as Hugging Face's Trainer
// saves it with optim="adamw_torch_8bit" (checkpoint-N/optimizer.pt) or a plain loop with
// torch.save(optimizer.state_dict()). Read through the torch.save driver (the same zip, pickle
// interpreter and tensor rebuilds; torchsave/, whose reader knows torchao's OptimState8bit,
// OptimStateFp8 and OptimState4bit), written here so that torchao's load_state_dict takes it and
// steps on with 8-bit moments. Layout: FORMAT.md.
#include "dcp/dcp_driver.h"
#include "optstate/checkpoint.h"
#include "torchao_layout.h"
#include "torchsave/torchsave_reader.h"

namespace optstate::torchao {

namespace fs = std::filesystem;

namespace {

class TorchaoDriver final : public FormatDriver {
 public:
  std::string_view name() const override { return "torchao"; }

  // A torch.save file (first record <folder>/data.pkl) of torchao's optimizer state.
  bool sniff(const fs::path& path) const override {
    return torchsave::is_torch_save_of(path, torchsave::Family::kTorchao);
  }

  Result<std::unique_ptr<CheckpointReader>> open(const fs::path& path) const override {
    return torchsave::open_file(path);  // says "torchao" when it read torchao's state
  }

  OptimizerState kept(const OptimizerState& state) const override { return kept_state(state); }
  OptimizerState kept_by_write(const OptimizerState& state, const WriteOptions& options) const override {
    return torchsave::framed_read_back(kept_state(state), options);
  }

  // torchao quantizes tensor.view(-1, block_size): a param of no whole number of blocks keeps fp32.
  QuantizeOptions quantize_rule(const QuantizeOptions& q) const override {
    QuantizeOptions whole = q;
    whole.whole_blocks = true;
    return whole;
  }

  // A training loop's own file ({"model", "optimizer", "epoch"}, Lightning's .ckpt): its other
  // entries go with the state (torchsave::write_carrying).
  bool keeps_group_extras() const override { return true; }
  // A file written from a DCP holds its buffers and tied names in the model dict (torchsave::write_framed).
  bool keeps_model_tensors() const override { return true; }
  bool carries(const CheckpointReader& source, const fs::path&) const override {
    return torchsave::carries_file(source);
  }

  std::vector<std::string> write_notes(const OptimizerState& kept, const WriteOptions& options) const override {
    std::vector<std::string> notes = dcp::torchao_package_notes(kept, options);
    for (std::string& n : torchsave::framed_read_back_notes(kept, options)) notes.push_back(std::move(n));
    return notes;
  }

  Status write(StateSource& source, const fs::path& path, const WriteOptions& options) const override {
    OPTSTATE_ASSIGN_OR_RETURN(const std::string_view package, dcp::written_torchao_package(options));
    return torchsave::write_framed(source, path, options, [&](pickle::Writer& w, const torchsave::SpecSink& add,
                                                              const torchsave::FrameOptions& fo) {
      return plan_frame(source.meta(), w, add, fo, package);
    });
  }
};

}  // namespace

const FormatDriver& driver() {
  static const TorchaoDriver d;
  return d;
}

}  // namespace optstate::torchao
