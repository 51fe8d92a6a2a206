// Whole-checkpoint fuzzing: a real checkpoint is written once; each input replaces its index (a
// directory format's manifest.json or .metadata; a single-file format's header) and may damage its
// data (a data file; the bytes after the header); then every reader path runs (validate, open, hash,
// a full read). Any bytes must give a result or an error; never a crash, a hang or an unbounded
// allocation. Used by formats/<name>/fuzz_<name>_checkpoint.cpp.
#pragma once

#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "fuzz_mutate.h"
#include "optstate/checkpoint.h"
#include "optstate/hash.h"
#include "optstate/transform.h"
#include "optstate/validate.h"
#include "registry.h"

namespace optstate::fuzz {

// Two params: a weight with 8-bit moments (block 64) and a bias with dense ones.
inline OptimizerState sample_state() {
  OptimizerState st;
  st.groups.push_back({});
  st.groups[0].params = {"a.weight", "a.bias"};
  auto add = [&](const std::string& fqn, std::vector<int64_t> shape) {
    ParamState ps;
    ps.shape = shape;
    ps.step = 5;
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    for (std::string name : {"exp_avg", "exp_avg_sq"}) {
      const bool second = name == "exp_avg_sq";  // second moments are non-negative
      std::vector<float> v(static_cast<size_t>(n));
      for (size_t i = 0; i < v.size(); ++i)
        v[i] = (second ? 1e-4f : 1e-2f) * static_cast<float>(static_cast<int>((i * 37) % 101) - (second ? 0 : 50));
      Entry e;
      e.values = Buffer::copy_of(std::as_bytes(std::span(v)));
      ps.entries.emplace(name, e);
    }
    st.params.emplace(fqn, ps);
  };
  add("a.weight", {24, 32});
  add("a.bias", {24});
  QuantizeOptions q;
  q.block_size = 64;
  q.min_8bit_size = 256;
  return *quantize_state(st, q);
}

// sample_state() as a source whose model holds other tensors beside it (a BatchNorm's running mean
// and int64 count, as a torch.save file of the model and optimizer gives them): a DCP written from
// it holds them as model.<name> items, which its reader streams as the model's other tensors.
class WithModelTensors final : public CheckpointReader {
 public:
  WithModelTensors() : inner_(memory_reader(sample_state(), "<sample with model tensors>")) {
    for (size_t i = 0; i < mean_.size(); ++i) mean_[i] = 0.25f * static_cast<float>(i) - 3.0f;
  }
  std::string_view format() const override { return inner_->format(); }
  const std::filesystem::path& path() const override { return inner_->path(); }
  const OptimizerState& meta() const override { return inner_->meta(); }
  Status stream(const std::string& fqn, const std::string& entry, Component c, const ByteSink& sink) override {
    return inner_->stream(fqn, entry, c, sink);
  }
  std::span<const ModelTensorInfo> model_tensors() const override { return tensors_; }
  Status stream_model_tensor(size_t index, const ByteSink& sink) const override {
    if (index == 0) return sink(std::as_bytes(std::span(mean_)));
    if (index == 1) return sink(std::as_bytes(std::span(&count_, 1)));
    return CheckpointReader::stream_model_tensor(index, sink);
  }

 private:
  std::unique_ptr<CheckpointReader> inner_;
  std::array<float, 24> mean_{};
  int64_t count_ = 5;
  std::vector<ModelTensorInfo> tensors_{{"a.running_mean", DType::kF32, {24}}, {"a.num_batches_tracked", DType::kI64, {}}};
};

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

inline void write_file(const std::filesystem::path& p, std::string_view bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

class CheckpointFixture {
 public:
  using Files = std::vector<std::pair<std::filesystem::path, std::string>>;  // relative path, bytes
  // A single-file format's header size: the index is the file's first index_size(file) bytes.
  using IndexSize = std::function<size_t(std::string_view file)>;

  // Writes sample_state() as `format` with `world_size` ranks (`quantized`: as convert --to 8bit
  // writes it: DCP with torchao's items; `model_tensors`: with WithModelTensors' beside it, where
  // the format keeps them); `index_name` is the file inputs replace.
  CheckpointFixture(std::string_view format, int world_size, std::string index_name, bool quantized = false,
                    bool model_tensors = false)
      : driver_(find_format(format)), index_name_(std::move(index_name)) {
    namespace fs = std::filesystem;
    write_seed(format, world_size, quantized, model_tensors);
    index_ = read_file(base_ / "seed" / index_name_);
    for (const auto& e : fs::recursive_directory_iterator(base_ / "seed"))
      if (e.is_regular_file() && fs::relative(e.path(), base_ / "seed") != fs::path(index_name_))
        data_.emplace_back(fs::relative(e.path(), base_ / "seed"), read_file(e.path()));
  }
  // Writes sample_state() as the single-file `format`; inputs replace its header.
  CheckpointFixture(std::string_view format, const IndexSize& index_size) : driver_(find_format(format)) {
    write_seed(format, 1);
    const std::string file = read_file(base_ / "seed");
    const size_t n = index_size(file);
    if (n > file.size()) std::abort();
    index_ = file.substr(0, n);
    data_.emplace_back(std::filesystem::path(), file.substr(n));
  }
  // A directory that exists already (real files another writer made: a per-rank set of torch.save
  // files), copied; inputs replace its file `index_name`.
  // `write_format` (with `write_world` ranks): what inputs are written back as, where not `format`
  // itself or native (DeepSpeed's ZeRO-3 writer, which writes only from a ZeRO-3 source).
  CheckpointFixture(std::string_view format, const std::filesystem::path& seed_dir, std::string index_name,
                    std::string_view write_format = "", int write_world = 1)
      : driver_(find_format(format)), write_driver_(write_format.empty() ? nullptr : find_format(write_format)),
        write_world_(write_world), index_name_(std::move(index_name)) {
    namespace fs = std::filesystem;
    base_ = fs::temp_directory_path() / fmt_name(format);
    fs::remove_all(base_);
    fs::create_directories(base_);
    std::error_code ec;
    fs::copy(seed_dir, base_ / "seed", fs::copy_options::recursive, ec);
    if (ec || !driver_) std::abort();
    index_ = read_file(base_ / "seed" / index_name_);
    for (const auto& e : fs::recursive_directory_iterator(base_ / "seed"))
      if (e.is_regular_file() && fs::relative(e.path(), base_ / "seed") != fs::path(index_name_))
        data_.emplace_back(fs::relative(e.path(), base_ / "seed"), read_file(e.path()));
  }
  ~CheckpointFixture() {
    std::error_code ec;
    std::filesystem::remove_all(base_, ec);
  }

  const std::string& index() const { return index_; }
  const Files& data() const { return data_; }

  // Lays out `index` and `data` as a checkpoint and runs every reader path; whether it opened.
  bool run(std::string_view index, const Files& data) const {
    namespace fs = std::filesystem;
    const fs::path work = base_ / "work";
    fs::remove_all(work);
    if (single_file()) {
      write_file(work, std::string(index).append(data.at(0).second));
    } else {
      fs::create_directories((work / index_name_).parent_path());
      write_file(work / index_name_, index);
      for (const auto& [rel, bytes] : data) {
        fs::create_directories((work / rel).parent_path());
        write_file(work / rel, bytes);
      }
    }
    const FormatDriver* d = driver_;
    (void)validate_checkpoint(work, [d](const fs::path& p) { return d->open(p); });
    auto r = d->open(work);
    if (!r.ok()) return false;
    (void)hash_checkpoint(**r);
    // The model's other tensors (a torch.save file's buffers) stream as many bytes as their shape
    // says, or fail.
    const auto tensors = (*r)->model_tensors();
    for (size_t i = 0; i < tensors.size(); ++i) {
      uint64_t got = 0;
      const Status st = (*r)->stream_model_tensor(i, [&](std::span<const std::byte> piece) {
        got += piece.size();
        return Status::Ok();
      });
      const auto numel = checked_numel(tensors[i].shape);
      if (st.ok() && (!numel.ok() || got != static_cast<uint64_t>(*numel) * dtype_size(tensors[i].dtype)))
        die("model tensor", "streamed another size than its shape's", tensors[i].name);
    }
    auto state = load_all(**r);
    const bool float_lr = index.size() % 2 == 1;
    const bool wrote = state.ok() && check_written_back(*state, **r, float_lr);
    check_streamed(state.ok() ? &*state : nullptr, wrote, **r, float_lr);
    return true;
  }

  // What was read writes back in the same format and reads again as the same values. A write that
  // succeeds but does not read back, or reads back different, is a bug: abort. `float_lr` (DCP:
  // tensor lrs written as numbers) alternates with the input's length. Whether the write succeeded.
  bool check_written_back(const OptimizerState& state, const CheckpointReader& source, bool float_lr) const {
    const std::filesystem::path out = base_ / "out";
    auto entries = memory_source(state);
    if (!write_back(*entries, source, float_lr, out).ok()) return false;
    expect_values(out, state, options(source, float_lr), "written back");
    return true;
  }

  // Written as convert writes, streamed entry by entry from the reader: where reading failed, the
  // write fails and leaves nothing (no output, no staging); where it did not, it succeeds exactly
  // when the in-memory write did and reads back as the same values.
  void check_streamed(const OptimizerState* state, bool memory_wrote, CheckpointReader& source, bool float_lr) const {
    namespace fs = std::filesystem;
    const fs::path out = base_ / "streamed";
    auto entries = reader_source(source);
    const Status st = write_back(*entries, source, float_lr, out);
    if (!st.ok()) {
      if (state && memory_wrote) die("streamed write", "failed where the in-memory write succeeded", st.message());
      std::error_code ec;
      for (const auto& e : fs::directory_iterator(base_, ec))
        if (e.path().filename().string().rfind(".streamed", 0) == 0 || e.path() == out)
          die("streamed write", "a failed write left", e.path().string());
      return;
    }
    if (!state) die("streamed write", "succeeded although reading the source failed", "");
    if (!memory_wrote) die("streamed write", "succeeded where the in-memory write failed", "");
    expect_values(out, *state, options(source, float_lr), "streamed write");
  }

  // Writes `entries` to `out` in the fixture's format, the reader handed over as the source (as
  // convert does: a DCP keeps its layout and carries its other items through).
  WriteOptions options(const CheckpointReader& source, bool float_lr) const {
    WriteOptions wo;
    wo.source = &source;
    wo.float_lr = float_lr;
    wo.world_size = write_world_;
    return wo;
  }
  Status write_back(StateSource& entries, const CheckpointReader& source, bool float_lr,
                    const std::filesystem::path& out) const {
    std::filesystem::remove_all(out);
    return writer()->write(entries, out, options(source, float_lr));
  }

  // What `out` holds opens and has the values of what the format keeps of `state` written with `wo`
  // (kept_by_write(): torchao's lr as float32, LibTorch's numbered params); anything else aborts,
  // naming `how`.
  void expect_values(const std::filesystem::path& out, const OptimizerState& state, const WriteOptions& wo,
                     const char* how) const {
    HashOptions values;
    values.values = true;
    auto back = writer()->open(out);
    if (!back.ok()) die(how, "wrote a checkpoint that does not open", back.status().message());
    auto got = hash_checkpoint(**back, values),
         want = hash_checkpoint(*memory_reader(writer()->kept_by_write(state, wo)), values);
    if (!want.ok() || !got.ok() || want->root != got->root)
      die(how, "the values differ", got.ok() ? (want.ok() ? "hash" : want.status().message()) : got.status().message());
  }

  static void die(const char* how, const char* what, const std::string& why) {
    std::fprintf(stderr, "%s: %s: %s\n", how, what, why.c_str());
    std::abort();
  }

  // The target's main() without libFuzzer: `--print-seed` prints the index file (the seed kept in
  // testdata/checkpoint/); `--write-seed DIR` writes the whole checkpoint (for seeds made from it);
  // else `[ITERATIONS] [SEED] [INDEX_FILE...]`, the bounded mutation run of CTest: two in three
  // inputs mutate an index (the fixture's and each INDEX_FILE in turn, passed through `sign`,
  // which re-signs it where the format has a checksum), one in three damages a data file. An
  // INDEX_FILE that does not open on the fixture's data as it is fails the run: a stale seed.
  int main(int argc, char** argv, const char* test, std::string_view alphabet,
           const std::function<std::optional<std::string>(const std::string&)>& sign) const {
    if (argc > 1 && std::string_view(argv[1]) == "--print-seed") {
      std::fwrite(index_.data(), 1, index_.size(), stdout);
      return 0;
    }
    if (argc > 2 && std::string_view(argv[1]) == "--write-seed") {
      std::error_code ec;
      std::filesystem::copy(base_ / "seed", argv[2], std::filesystem::copy_options::recursive, ec);  // a file too
      return ec ? 1 : 0;
    }
    const long iterations = argc > 1 ? std::atol(argv[1]) : 500;
    std::mt19937_64 rng(argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1);
    std::vector<std::string> starts{index_};
    for (int a = 3; a < argc; ++a) {
      starts.push_back(read_file(argv[a]));
      if (starts.back().empty() || !run(starts.back(), data_)) {
        std::fprintf(stderr, "%s: seed %s does not open on the fixture's data (stale: see docs/fuzzing.md)\n", test,
                     argv[a]);
        return 1;
      }
    }
    long opened = 0;
    const auto current = std::make_shared<std::atomic<long>>(0);
    watch_for_hangs(test, current);
    const auto started = std::chrono::steady_clock::now();
    const long report_every = iterations >= 20000 ? iterations / 10 : 0;
    for (long i = 0; i < iterations; ++i) {
      current->store(i + 1);  // 1-based: 0 is "not started"
      if (report_every && i && i % report_every == 0)
        std::fprintf(stderr, "%s: %ld of %ld inputs, %ld opened, %.0f s\n", test, i, iterations, opened,
                     std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
      std::string index = starts[static_cast<size_t>(i) % starts.size()];
      Files data = data_;
      const size_t damaged = rng() % data.size();
      if (i % 3 != 2 || data[damaged].second.empty()) {
        mutate(index, rng, alphabet);
        if (auto s = sign(index)) index = *s;
      } else {
        mutate(data[damaged].second, rng, "");
      }
      opened += run(index, data);
    }
    current->store(-1);  // done: the watchdog stands down
    std::printf("%s: %ld inputs, %ld opened, no crash\n", test, iterations, opened);
    return 0;
  }

  // A hang or an unbounded allocation is what the loop cannot report itself: a thread watches the
  // input number and the process's resident memory. When one input has run longer than
  // OPTSTATE_FUZZ_HANG_SECONDS (default 120; ASan builds are slow), or the process holds more than
  // OPTSTATE_FUZZ_RSS_MB (default 4096; a run of these targets stays under 1 GiB), it names the
  // input, keeps its bytes (the fixture's `work`, left in place) and ends the process with status
  // 3 (a hang) or 4 (memory).
  void watch_for_hangs(const char* test, std::shared_ptr<std::atomic<long>> current) const {
    const auto env_or = [](const char* name, long fallback) {
      const char* env = std::getenv(name);
      return env && std::atol(env) > 0 ? std::atol(env) : fallback;
    };
    const long limit = env_or("OPTSTATE_FUZZ_HANG_SECONDS", 120), rss_limit_mb = env_or("OPTSTATE_FUZZ_RSS_MB", 4096);
    const std::string work = (base_ / "work").string();
    std::thread([test, current, limit, rss_limit_mb, work] {
      long seen = 0, since = 0;
      const long page = sysconf(_SC_PAGESIZE);
      for (;;) {
        std::this_thread::sleep_for(std::chrono::seconds(1));
        const long now = current->load();
        if (now < 0) return;
        long pages = 0, resident = 0;
        if (FILE* f = std::fopen("/proc/self/statm", "r")) {
          if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
          std::fclose(f);
        }
        if (now > 0 && resident / (1024 * 1024 / page) > rss_limit_mb) {
          std::fprintf(stderr, "%s: input %ld holds %ld MiB, over %ld: an unbounded allocation; its bytes are in %s\n",
                       test, now - 1, resident / (1024 * 1024 / page), rss_limit_mb, work.c_str());
          std::fflush(stderr);
          std::_Exit(4);
        }
        if (now != seen) {
          seen = now;
          since = 0;
        } else if (++since >= limit && now > 0) {
          std::fprintf(stderr, "%s: input %ld has run for %ld s: a hang; its bytes are in %s\n", test, now - 1,
                       since, work.c_str());
          std::fflush(stderr);
          std::_Exit(3);
        }
      }
    }).detach();
  }

 private:
  bool single_file() const { return index_name_.empty(); }

  void write_seed(std::string_view format, int world_size, bool quantized = false, bool model_tensors = false) {
    namespace fs = std::filesystem;
    base_ = fs::temp_directory_path() / fmt_name(format);
    fs::remove_all(base_);
    fs::create_directories(base_);
    WriteOptions wo;
    wo.world_size = world_size;
    wo.quantized = quantized;
    const WithModelTensors with_model;
    if (model_tensors) wo.source = &with_model;
    if (!driver_ || !driver_->write(sample_state(), base_ / "seed", wo).ok()) std::abort();
  }

  static std::string fmt_name(std::string_view format) {
    return "optstate-fuzz-" + std::string(format) + "-" + std::to_string(::getpid());
  }

  const FormatDriver* driver_;
  // What the write-back writes: the format itself, or native for a format optstate only reads.
  const FormatDriver* writer() const {
    return write_driver_ ? write_driver_ : driver_->writes() ? driver_ : find_format("native");
  }
  const FormatDriver* write_driver_ = nullptr;
  int write_world_ = 1;
  std::string index_name_;
  std::filesystem::path base_;
  std::string index_;
  Files data_;
};

}  // namespace optstate::fuzz
