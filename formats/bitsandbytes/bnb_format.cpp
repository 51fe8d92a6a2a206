// The bitsandbytes driver: the optimizer state_dict of bitsandbytes' AdamW8bit / AdamW, as
// Hugging Face's Trainer saves it with optim="adamw_bnb_8bit" (checkpoint-N/optimizer.pt). Read
// through the torch.save driver (the same zip, pickle interpreter and tensor rebuilds; torchsave/,
// whose reader knows bitsandbytes' names), written here so that bitsandbytes' load_state_dict takes
// it and steps on. Layout: FORMAT.md.
#include "bnb_layout.h"
#include "dcp/dcp_driver.h"
#include "optstate/checkpoint.h"
#include "optstate/quant8.h"
#include "optstate/transform.h"
#include "torchsave/torchsave_reader.h"

namespace optstate::bitsandbytes {

namespace fs = std::filesystem;

namespace {

class BitsandbytesDriver final : public FormatDriver {
 public:
  std::string_view name() const override { return "bitsandbytes"; }

  // A torch.save file (first record <folder>/data.pkl) whose pickle names "state1" and "state2".
  bool sniff(const fs::path& path) const override {
    const auto first = torchsave::first_zip_record(path);
    return first && first->size() > 9 && first->ends_with("/data.pkl") && torchsave::state_family(path) == torchsave::Family::kBitsandbytes;
  }

  Result<std::unique_ptr<CheckpointReader>> open(const fs::path& path) const override {
    return torchsave::open_file(path);  // says "bitsandbytes" when it read bitsandbytes' state
  }

  OptimizerState kept(const OptimizerState& state) const override { return kept_state(state); }

  Status write(StateSource& source, const fs::path& path, const WriteOptions& options) const override {
    const OptimizerState& meta = source.meta();
    OPTSTATE_ASSIGN_OR_RETURN(const Plan plan, plan_state_dict(meta));
    return torchsave::write_file(path, options.overwrite, plan.data_pkl, [&](dcp::ArchiveWriter& archive) -> Status {
      std::string loaded_key;  // one entry held at a time; its components are written in turn
      Entry loaded;
      for (size_t i = 0; i < plan.storages.size(); ++i) {
        const StorageSpec& s = plan.storages[i];
        const std::string key = std::to_string(i);
        if (!s.qmap.empty()) {
          OPTSTATE_ASSIGN_OR_RETURN(const QMap m, qmap_from_name(s.qmap));
          OPTSTATE_RETURN_IF_ERROR(archive.storage(key, std::as_bytes(std::span(qmap_table(m)))));
          continue;
        }
        if (loaded_key != entry_key(s.fqn, s.entry)) {
          loaded = Entry{};
          OPTSTATE_ASSIGN_OR_RETURN(loaded, source.load(s.fqn, s.entry));
          loaded_key = entry_key(s.fqn, s.entry);
        }
        if (s.to_f32) {
          OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(meta.params.at(s.fqn).shape));
          OPTSTATE_ASSIGN_OR_RETURN(const std::vector<float> values, entry_f32_values(loaded, numel, loaded_key));
          OPTSTATE_RETURN_IF_ERROR(archive.storage(key, std::as_bytes(std::span(values))));
          continue;
        }
        OPTSTATE_RETURN_IF_ERROR(archive.storage(key, loaded.buffer(s.component).span()));
      }
      return Status::Ok();
    });
  }
};

}  // namespace

const FormatDriver& driver() {
  static const BitsandbytesDriver d;
  return d;
}

}  // namespace optstate::bitsandbytes
