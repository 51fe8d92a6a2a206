// The LibTorch driver: LibTorch's optimizer archive, what a C++ training loop's
// torch::save(optimizer, "optimizer.pt") writes and torch::load(optimizer, ...) reads, for
// torch::optim::AdamW and optstate's FusedAdamW and AdamW8bit. Read through the torch.save driver
// (the same zip container, pickle interpreter and tensor rebuilds; torchsave/), written here as
// LibTorch writes it: storages first, then data.pkl, one TorchScript class per archive level,
// constants.pkl, version, byteorder. Layout: FORMAT.md.
#include <fmt/format.h>

#include <cstring>

#include "dcp/zip.h"
#include "libtorch_layout.h"
#include "optstate/checkpoint.h"
#include "optstate/io.h"
#include "optstate/quant8.h"
#include "registry.h"
#include "torchsave/torchsave_reader.h"

namespace optstate::libtorch {

namespace fs = std::filesystem;

namespace {

// Records go under one folder; LibTorch names it after the file for paths ("archive" for streams).
constexpr const char* kFolder = "archive";

class LibTorchDriver final : public FormatDriver {
 public:
  std::string_view name() const override { return "libtorch"; }

  // A zip whose first record is <folder>/data/0: LibTorch writes the storages before data.pkl
  // (torch.save writes data.pkl first), and an optimizer archive always has a storage (its counts).
  bool sniff(const fs::path& path) const override {
    const auto first = torchsave::first_zip_record(path);
    const auto slash = first ? first->find('/') : std::string::npos;
    return slash != std::string::npos && slash > 0 && first->substr(slash) == "/data/0";
  }

  OptimizerState kept(const OptimizerState& state) const override {
    OptimizerState out;
    out.kind = state.kind;
    out.format_version = state.format_version;
    size_t index = 0;
    for (size_t g = 0; g < state.groups.size(); ++g) {
      ParamGroup group{state.groups[g].hyper, {}};
      for (const std::string& fqn : state.groups[g].params) {
        const std::string number = std::to_string(index++);
        ParamState ps = state.params.at(fqn);
        ps.entries.erase(kParam);
        if (ps.entries.empty()) continue;  // listed without state: no shape in the archive
        ps.param_dtype = DType::kF32;      // without the weights, as the readers take it
        group.params.push_back(number);
        out.params.emplace(number, std::move(ps));
      }
      out.groups.push_back(std::move(group));
    }
    return out;
  }

  Result<std::unique_ptr<CheckpointReader>> open(const fs::path& path) const override {
    OPTSTATE_ASSIGN_OR_RETURN(auto reader, torchsave::open_file(path));
    if (reader->format() != "libtorch")
      return corrupt(fmt::format("{}: a torch.save'd state_dict, not LibTorch's optimizer archive", path.string()));
    return reader;
  }

  Status write(StateSource& source, const fs::path& path, const WriteOptions& options) const override {
    const OptimizerState& meta = source.meta();
    OPTSTATE_ASSIGN_OR_RETURN(const ArchivePlan plan, plan_archive(meta, options.dequantize));
    OPTSTATE_RETURN_IF_ERROR(check_destination(path, options.overwrite));
    OPTSTATE_ASSIGN_OR_RETURN(Staging staging, Staging::file(path));
    Status st = [&]() -> Status {
      OPTSTATE_ASSIGN_OR_RETURN(OutputFile out, OutputFile::create(staging.path()));
      zip::Builder zb;
      auto put = [&](const std::string& name, std::span<const std::byte> data) -> Status {
        const std::string h = zb.local_header(fmt::format("{}/{}", kFolder, name), data.size(), zip::crc32(data), out.offset());
        OPTSTATE_RETURN_IF_ERROR(out.write(std::as_bytes(std::span(h))));
        return out.write(data);
      };
      auto text = [](const std::string& s) { return std::as_bytes(std::span(s)); };
      // One entry loaded at a time; its components written as the plan orders them.
      std::string loaded_key;
      Entry loaded;
      for (size_t i = 0; i < plan.storages.size(); ++i) {
        const StorageSpec& s = plan.storages[i];
        const std::string name = fmt::format("data/{}", i);
        if (s.fqn.empty()) {
          OPTSTATE_RETURN_IF_ERROR(put(name, text(s.bytes)));
          continue;
        }
        if (loaded_key != entry_key(s.fqn, s.entry)) {
          loaded = Entry{};  // one entry held at a time
          OPTSTATE_ASSIGN_OR_RETURN(loaded, source.load(s.fqn, s.entry));
          loaded_key = entry_key(s.fqn, s.entry);
        }
        if (s.dequantize) {
          OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(meta.params.at(s.fqn).shape));
          OPTSTATE_ASSIGN_OR_RETURN(const QMap m, qmap_from_name(loaded.qmap));
          std::vector<float> values(static_cast<size_t>(numel));
          dequantize_blockwise({reinterpret_cast<const uint8_t*>(loaded.codes.data), loaded.codes.size},
                               {reinterpret_cast<const float*>(loaded.absmax.data), loaded.absmax.size / 4},
                               loaded.block_size, m, values);
          OPTSTATE_RETURN_IF_ERROR(put(name, std::as_bytes(std::span(values))));
          continue;
        }
        OPTSTATE_RETURN_IF_ERROR(put(name, loaded.buffer(s.component).span()));
      }
      OPTSTATE_RETURN_IF_ERROR(put("data.pkl", text(plan.data_pkl)));
      for (const auto& [file, source_text] : plan.code) OPTSTATE_RETURN_IF_ERROR(put(file, text(source_text)));
      const std::string empty_tuple = "\x80\x02).";  // constants.pkl: no constants
      OPTSTATE_RETURN_IF_ERROR(put("constants.pkl", text(empty_tuple)));
      OPTSTATE_RETURN_IF_ERROR(put("version", text("3\n")));
      OPTSTATE_RETURN_IF_ERROR(put("byteorder", text("little")));
      const std::string tail = zb.finish(out.offset());
      OPTSTATE_RETURN_IF_ERROR(out.write(std::as_bytes(std::span(tail))));
      return out.sync_and_close();
    }();
    return staging.commit(st, options.overwrite);
  }
};

}  // namespace

const FormatDriver& driver() {
  static const LibTorchDriver d;
  return d;
}

}  // namespace optstate::libtorch
