// The conformance test every format driver passes: write the canonical sample state, sniff it, read
// it back, and get the same hash; refuse to overwrite unless asked. A new driver folder is picked
// up here without touching this file.
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "optstate/hash.h"
#include "optstate/io.h"
#include "optstate/transform.h"
#include "registry.h"
#include "test_helpers.h"

using namespace optstate;

TEST_CASE("every format driver round-trips the canonical state with an equal hash") {
  const OptimizerState dense = testing::sample_state();
  const OptimizerState eight = *quantize_state(dense, {4, 1});  // blockwise8 with a partial last block
  REQUIRE(!format_drivers().empty());
  for (const FormatDriver* d : format_drivers())
    for (const OptimizerState* sp : {&dense, &eight}) {
    if (!d->writes()) continue;  // read-only (DeepSpeed): its readers are tested on real files
    const OptimizerState& state = *sp;
    const OptimizerState kept = d->kept(state);  // LibTorch's archive: params numbered, no weights
    auto want = hash_state(kept);
    REQUIRE(want.ok());
    CAPTURE(d->name());
    CAPTURE(sp == &eight);
    testing::TempDir dir;
    const auto path = dir.path / ("ckpt." + std::string(d->name()));
    REQUIRE(d->write(state, path, {}).ok());
    CHECK(d->sniff(path));
    for (const FormatDriver* other : format_drivers())
      if (other != d) CHECK_FALSE(other->sniff(path));
    auto reader = open_checkpoint(path);
    REQUIRE(reader.ok());
    CHECK((*reader)->format() == d->name());
    // Formats that store 8-bit entries dequantized keep the values hash; all others the raw one.
    const bool raw = d->keeps_blockwise8() || sp == &dense;
    auto got = hash_checkpoint(**reader, {.values = !raw});
    REQUIRE(got.ok());
    auto want_here = raw ? want : hash_state(kept, {.values = true});
    CHECK(got->root == want_here->root);
    CHECK(got->entries == want_here->entries);
    CHECK(!d->write(state, path, {}).ok());
    CHECK(d->write(state, path, {.overwrite = true}).ok());
    CHECK(!d->sniff(dir.path / "missing"));
    // dequantize-on-save: the reader gets dense entries with the same values
    REQUIRE(write_checkpoint(*d, state, dir.path / "dq", {.dequantize = true}).ok());
    auto dq = open_checkpoint(dir.path / "dq");
    REQUIRE(dq.ok());
    for (const auto& [fqn, ps] : (*dq)->meta().params)
      for (const auto& [name, e] : ps.entries) CHECK(e.encoding == Encoding::kDense);
    CHECK(hash_checkpoint(**dq, {.values = true})->root == hash_state(kept, {.values = true})->root);
    // written again from itself as the source (what convert hands a driver): the same values
    auto again = load_all(**reader);
    REQUIRE(again.ok());
    REQUIRE(d->write(*again, dir.path / "again", {.source = reader->get()}).ok());
    auto back = open_checkpoint(dir.path / "again");
    REQUIRE(back.ok());
    CHECK(hash_checkpoint(**back, {.values = true})->root == hash_state(kept, {.values = true})->root);
  }
}

TEST_CASE("dcp: a step torch.optim.AdamW's float32 step cannot hold exactly is refused, not rounded") {
  OptimizerState state = testing::sample_state();
  const FormatDriver* dcp = find_format("dcp");
  REQUIRE(dcp);
  testing::TempDir dir;
  state.params.begin()->second.step = (int64_t{1} << 24) + 1;
  const Status st = dcp->write(state, dir.path / "c", {});
  CHECK(st.code() == ErrorCode::kInvalidArgument);
  CHECK(st.message().find("step 16777217") != std::string::npos);
  CHECK(!std::filesystem::exists(dir.path / "c"));
  state.params.begin()->second.step = int64_t{1} << 24;  // the last exact one
  CHECK(dcp->write(state, dir.path / "c", {}).ok());
}

TEST_CASE("every format driver writes a NaN or infinite hyperparameter that reads back, or refuses it leaving nothing") {
  // A diverged LR schedule's NaN lr: pickles (torch.save, DCP, LibTorch's archive) hold it; JSON
  // metadata (native, safetensors, HDF5) cannot, and those writers refuse it by group.
  for (const double bad : {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()})
    for (const FormatDriver* d : format_drivers()) {
      if (!d->writes()) continue;
      CAPTURE(d->name());
      CAPTURE(bad);
      OptimizerState state = testing::sample_state();
      state.groups.back().hyper.lr = bad;
      testing::TempDir dir;
      const auto path = dir.path / ("ckpt." + std::string(d->name()));
      const Status st = d->write(state, path, {});
      if (!st.ok()) {
        CHECK(st.code() == ErrorCode::kInvalidArgument);
        CHECK(st.message().find(fmt::format("param group {}: lr is", state.groups.size() - 1)) != std::string::npos);
        CHECK(std::filesystem::is_empty(dir.path));
        continue;
      }
      auto back = open_checkpoint(path);
      REQUIRE_MESSAGE(back.ok(), back.status().message());
      const double lr = (*back)->meta().groups.back().hyper.lr;
      CHECK((std::isnan(bad) ? std::isnan(lr) : lr == bad));
    }
}

TEST_CASE("every format driver stops a write when interrupted: kCancelled, nothing published, nothing left") {
  const OptimizerState eight = *quantize_state(testing::sample_state(), {4, 1});
  for (const FormatDriver* d : format_drivers()) {
    if (!d->writes()) continue;  // read-only (DeepSpeed)
    CAPTURE(d->name());
    testing::TempDir dir;
    const auto path = dir.path / ("ckpt." + std::string(d->name()));
    request_interrupt(SIGINT);  // as the CLI's signal handler does
    const Status st = d->write(eight, path, {});
    clear_interrupt();
    CHECK(st.code() == ErrorCode::kCancelled);
    CHECK(st.message().find("interrupted by signal 2") != std::string::npos);
    CHECK(std::distance(std::filesystem::directory_iterator(dir.path), {}) == 0);  // no DST, no staging
    // an existing checkpoint at DST stays as it was
    REQUIRE(d->write(eight, path, {}).ok());
    const auto before = hash_checkpoint(**open_checkpoint(path));
    request_interrupt(SIGTERM);
    CHECK(d->write(testing::sample_state(), path, {.overwrite = true}).code() == ErrorCode::kCancelled);
    clear_interrupt();
    CHECK(hash_checkpoint(**open_checkpoint(path))->root == before->root);
    CHECK(std::distance(std::filesystem::directory_iterator(dir.path), {}) == 1);
    CHECK(check_interrupt(path).ok());
  }
}

TEST_CASE("every format driver fails cleanly when the disk refuses a write: an error, nothing left, writes go on") {
  // The file size limit (ulimit -f) makes write(2) fail with EFBIG once a file would grow past it: a
  // full disk or a quota, deterministically. SIGXFSZ is ignored so the write fails instead.
  const OptimizerState eight = *quantize_state(testing::sample_state(), {4, 1});
  struct rlimit old {};
  REQUIRE(::getrlimit(RLIMIT_FSIZE, &old) == 0);
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  for (const FormatDriver* d : format_drivers()) {
    if (!d->writes()) continue;  // read-only (DeepSpeed)
    // limits: in the first bytes, and half way through the largest file
    testing::TempDir full;
    REQUIRE(d->write(eight, full.path / "c", {}).ok());
    const auto written = full.path / "c";
    uintmax_t largest = std::filesystem::is_regular_file(written) ? std::filesystem::file_size(written) : 0;
    if (std::filesystem::is_directory(written))
      for (const auto& f : std::filesystem::recursive_directory_iterator(written))
        if (f.is_regular_file()) largest = std::max(largest, f.file_size());
    const bool raw = d->keeps_blockwise8();  // else the values hash: 8-bit moments stored dequantized
    for (rlim_t limit : {rlim_t{64}, static_cast<rlim_t>(largest / 2)}) {
      CAPTURE(d->name());
      CAPTURE(limit);
      testing::TempDir dir;
      const auto path = dir.path / ("ckpt." + std::string(d->name()));
      struct rlimit small = old;
      small.rlim_cur = limit;
      REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
      const Status st = d->write(eight, path, {});
      REQUIRE(::setrlimit(RLIMIT_FSIZE, &old) == 0);
      CHECK(!st.ok());
      CHECK(st.code() == ErrorCode::kIoError);
      CHECK(st.message().rfind("writing " + path.string() + ": ", 0) == 0);  // names DST, not the staging path
      CHECK(st.message().find("File too large") != std::string::npos);     // and why, from the OS
      CHECK(std::distance(std::filesystem::directory_iterator(dir.path), {}) == 0);  // no DST, no staging
      // the same process writes and reads the next checkpoint as usual
      REQUIRE(d->write(eight, path, {}).ok());
      auto back = open_checkpoint(path);
      REQUIRE(back.ok());
      CHECK(hash_checkpoint(**back, {.values = !raw})->root == hash_state(d->kept(eight), {.values = !raw})->root);
    }
  }
  std::signal(SIGXFSZ, old_handler);
}

TEST_CASE("every format driver leaves nothing behind when an exception unwinds through a write") {
  const OptimizerState eight = *quantize_state(testing::sample_state(), {4, 1});
  for (const FormatDriver* d : format_drivers()) {
    if (!d->writes()) continue;  // read-only (DeepSpeed)
    for (int good : {0, 1}) {
      CAPTURE(d->name());
      CAPTURE(good);
      testing::TempDir dir;
      const auto path = dir.path / ("ckpt." + std::string(d->name()));
      testing::ThrowingSource throwing(eight, good);
      CHECK_THROWS_WITH_AS(d->write(throwing, path, {}), doctest::Contains("boom in load("), std::runtime_error);
      CHECK(std::distance(std::filesystem::directory_iterator(dir.path), {}) == 0);  // no DST, no staging
      // over an existing checkpoint: it stays as it was, and only it is there
      REQUIRE(d->write(eight, path, {}).ok());
      const auto before = hash_checkpoint(**open_checkpoint(path));
      const OptimizerState dense = testing::sample_state();
      testing::ThrowingSource again(dense, good);
      CHECK_THROWS_AS(d->write(again, path, {.overwrite = true}), std::runtime_error);
      CHECK(hash_checkpoint(**open_checkpoint(path))->root == before->root);
      CHECK(std::distance(std::filesystem::directory_iterator(dir.path), {}) == 1);
      CHECK(find_leftovers(path).empty());
    }
  }
}

TEST_CASE("a DST name of NAME_MAX bytes is written, replaced and its leftovers found") {
  const OptimizerState state = testing::sample_state();
  testing::TempDir dir;
  for (const FormatDriver* d : format_drivers()) {
    if (!d->writes()) continue;  // read-only (DeepSpeed)
    CAPTURE(d->name());
    const std::string name = std::string(d->name()) + std::string(255 - d->name().size(), 'n');
    const auto path = dir.path / name;
    REQUIRE(d->write(state, path, {}).ok());
    CHECK(d->write(state, path, {.overwrite = true}).ok());
    auto reader = open_checkpoint(path);
    REQUIRE(reader.ok());
    CHECK(hash_checkpoint(**reader)->root == hash_state(d->kept(state))->root);
    CHECK(std::distance(std::filesystem::directory_iterator(dir.path), {}) == 1);  // nothing else left
    std::filesystem::remove_all(path);
  }
  // What a killed write of such a DST leaves is recognized as its leftover, not another DST's.
  const auto path = dir.path / std::string(255, 'x');
  auto staging = make_staging_dir(path);
  REQUIRE(staging.ok());
  const std::string made = staging->filename().string(), pid = fmt::format("-{}-", ::getpid());
  const size_t at = made.find(pid);
  REQUIRE(at != std::string::npos);
  const std::string killed = made.substr(0, at) + "-999999999-" + made.substr(at + pid.size());
  std::filesystem::rename(*staging, dir.path / killed);
  const auto found = find_leftovers(path);
  REQUIRE(found.size() == 1);
  CHECK(found[0].path == dir.path / killed);
  CHECK(find_leftovers(dir.path / (std::string(254, 'x') + "y")).empty());
}

TEST_CASE("a DST whose folder is missing or is a file is refused, naming which, and nothing is written") {
  const OptimizerState state = testing::sample_state();
  testing::TempDir dir;
  {
    std::ofstream(dir.path / "afile") << "kept";
  }
  for (const FormatDriver* d : format_drivers()) {
    if (!d->writes()) continue;
    CAPTURE(d->name());
    const Status under_file = d->write(state, dir.path / "afile" / "out", {});
    REQUIRE_FALSE(under_file.ok());
    CHECK(under_file.message().find("'" + (dir.path / "afile").string() + "' is not a directory") !=
          std::string::npos);
    const Status under_missing = d->write(state, dir.path / "missing" / "out", {});
    REQUIRE_FALSE(under_missing.ok());
    CHECK(under_missing.code() == ErrorCode::kNotFound);
    CHECK(under_missing.message().find("parent directory does not exist") != std::string::npos);
  }
  CHECK(std::distance(std::filesystem::directory_iterator(dir.path), {}) == 1);  // only afile
  std::ifstream in(dir.path / "afile");
  std::string kept;
  in >> kept;
  CHECK(kept == "kept");
}

TEST_CASE("ranks(): the ranks whose files native and DCP checkpoints hold; none for one-file formats") {
  const OptimizerState state = testing::sample_state();
  testing::TempDir dir;
  for (const FormatDriver* d : format_drivers()) {
    if (!d->writes()) continue;
    CAPTURE(d->name());
    const bool by_rank = d->name() == "native" || d->name() == "dcp";  // files named by rank
    for (int world : {1, 3}) {
      if (world > 1 && !by_rank) continue;
      CAPTURE(world);
      const auto path = dir.path / fmt::format("{}-{}", d->name(), world);
      REQUIRE(d->write(state, path, {.world_size = world}).ok());
      auto reader = open_checkpoint(path);
      REQUIRE(reader.ok());
      CHECK((*reader)->ranks() == (by_rank ? std::optional<int64_t>(world) : std::nullopt));
    }
  }
}
