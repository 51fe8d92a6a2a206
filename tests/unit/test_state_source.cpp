// Writers take a StateSource and load one entry at a time (convert streams SRC into DST): the bytes
// written do not depend on where the entries come from, a writer never holds two entries, and a
// source that fails part way leaves no output.
#include <doctest/doctest.h>

#include <fmt/format.h>

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>

#include "optstate/hash.h"
#include "optstate/io.h"
#include "optstate/transform.h"
#include "registry.h"
#include "test_helpers.h"

using namespace optstate;
namespace fs = std::filesystem;

namespace {

// Every regular file under `root` (or `root` itself) by relative path, with its bytes.
std::map<std::string, std::string> tree(const fs::path& root) {
  std::map<std::string, std::string> out;
  if (fs::is_regular_file(root)) {
    out["."] = testing::read_file(root);
    return out;
  }
  for (const auto& f : fs::recursive_directory_iterator(root))
    if (f.is_regular_file()) out[fs::relative(f.path(), root).string()] = testing::read_file(f.path());
  return out;
}

std::vector<std::string> listing(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& f : fs::directory_iterator(dir)) names.push_back(f.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// A state with entries larger than one chunk piece would hide, and an odd-sized one.
OptimizerState larger_state() {
  OptimizerState s = testing::sample_state();
  ParamState ps;
  ps.shape = {37, 129};
  ps.group = 0;
  std::vector<float> a(37 * 129), b(37 * 129);
  for (size_t i = 0; i < a.size(); ++i) {
    a[i] = 0.001f * static_cast<float>(i % 977) - 0.4f;
    b[i] = 1e-6f * static_cast<float>(i % 313);
  }
  ps.entries[kExpAvg].values = testing::f32_buffer(a);
  ps.entries[kExpAvgSq].values = testing::f32_buffer(b);
  s.params["big.weight"] = ps;
  s.groups[0].params.push_back("big.weight");
  return s;
}

// Hands out copies of a state's entries whose buffers count themselves while alive.
class CountingSource final : public StateSource {
 public:
  explicit CountingSource(const OptimizerState& state) : inner_(memory_source(state)) {}
  const OptimizerState& meta() const override { return inner_->meta(); }
  Result<Entry> load(const std::string& fqn, const std::string& name) override {
    OPTSTATE_ASSIGN_OR_RETURN(Entry e, inner_->load(fqn, name));
    auto token = std::shared_ptr<void>(nullptr, [this](void*) { --live_; });
    max_live_ = std::max(max_live_, ++live_);
    ++loads_;
    for (Component c : e.components()) {
      Buffer& b = e.buffer(c);
      auto keep = std::make_shared<std::pair<std::shared_ptr<const void>, std::shared_ptr<void>>>(b.owner, token);
      b.owner = keep;
    }
    return e;
  }
  int live_ = 0, max_live_ = 0, loads_ = 0;

 private:
  std::unique_ptr<StateSource> inner_;
};

int entry_count(const OptimizerState& s) {
  int n = 0;
  for (const auto& [fqn, ps] : s.params) n += static_cast<int>(ps.entries.size());
  return n;
}

}  // namespace

TEST_CASE("every driver writes the same checkpoint streamed from a reader as from memory") {
  const OptimizerState dense = larger_state();
  const OptimizerState eight = *quantize_state(dense, {64, 1});
  testing::TempDir dir;
  REQUIRE(find_format("native")->write(dense, dir.path / "dense-src", {}).ok());
  REQUIRE(find_format("native")->write(eight, dir.path / "eight-src", {}).ok());
  for (const FormatDriver* d : format_drivers())
    for (int world : {1, 3}) {
      if (!d->writes()) continue;  // read-only (DeepSpeed)
      if (world > 1 && d->name() == "torchsave") continue;  // per-rank files only from such a set (test_torchsave.cpp)
      CAPTURE(d->name());
      CAPTURE(world);
      const std::string tag = fmt::format("{}-{}", d->name(), world);
      auto check = [&](const OptimizerState& in_memory, const fs::path& src, Recode how, const char* what) {
        CAPTURE(what);
        const fs::path a = dir.path / (tag + "-memory-" + what), b = dir.path / (tag + "-streamed-" + what);
        REQUIRE(d->write(in_memory, a, {.world_size = world}).ok());
        auto reader = open_checkpoint(src);
        REQUIRE(reader.ok());
        auto read = reader_source(**reader);
        auto recoded = recoded_source(*read, how, {64, 1});
        REQUIRE(write_checkpoint(*d, *recoded, b, {.world_size = world}).ok());
        // libhdf5 stamps object times into the file: HDF5 output is compared by content.
        if (d->name() != "hdf5") CHECK(tree(a) == tree(b));
        auto ra = open_checkpoint(a), rb = open_checkpoint(b);
        REQUIRE(ra.ok());
        REQUIRE(rb.ok());
        CHECK(hash_checkpoint(**ra)->root == hash_checkpoint(**rb)->root);
      };
      check(dense, dir.path / "dense-src", Recode::kKeep, "dense");
      check(eight, dir.path / "eight-src", Recode::kKeep, "eight");
      if (d->keeps_blockwise8()) check(eight, dir.path / "dense-src", Recode::kQuantize, "quantized");
      check(*dequantize_state(eight), dir.path / "eight-src", Recode::kDequantize, "dequantized");
    }
}

TEST_CASE("a writer holds one entry at a time and loads each once per pass") {
  const OptimizerState eight = *quantize_state(larger_state(), {64, 1});
  for (const FormatDriver* d : format_drivers())
    for (bool dequantize : {false, true}) {
      if (!d->writes()) continue;  // read-only (DeepSpeed)
      CAPTURE(d->name());
      CAPTURE(dequantize);
      testing::TempDir dir;
      CountingSource source(eight);
      const int world = d->name() == "torchsave" ? 1 : 2;  // per-rank files only from such a set
      REQUIRE(write_checkpoint(*d, source, dir.path / "c", {.dequantize = dequantize, .world_size = world}).ok());
      CHECK(source.max_live_ == 1);
      CHECK(source.live_ == 0);
      CHECK(source.loads_ == entry_count(d->kept(eight)));  // what the format holds
    }
}

TEST_CASE("a source that gives wrong bytes or fails part way leaves no output and names the entry") {
  // A buffer one byte short, in the last param's exp_avg_sq (a moment: every format writes it, a
  // LibTorch optimizer archive no weights): much was written before it.
  OptimizerState bad = larger_state();
  Buffer& short_buffer = bad.params.rbegin()->second.entries.at(kExpAvgSq).values;
  const std::string key = entry_key(bad.params.rbegin()->first, kExpAvgSq);
  short_buffer.size -= 1;
  // The native file's last bytes: the last param's last entry (its weights).
  const std::string last_key =
      entry_key(bad.params.rbegin()->first, bad.params.rbegin()->second.entries.rbegin()->first);
  REQUIRE(bad.params.rbegin()->second.entries.rbegin()->first == kParam);
  // A native source whose last chunk's data no longer matches its checksum.
  testing::TempDir dir;
  const fs::path src = dir.path / "src";
  REQUIRE(find_format("native")->write(larger_state(), src, {}).ok());
  REQUIRE(find_format("native")->write(larger_state(), dir.path / "intact", {}).ok());
  {
    const fs::path data = src / "data" / "rank-00000.bin";
    std::fstream f(data, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(data) - 3));
    f.put('\x7f');
  }
  for (const FormatDriver* d : format_drivers()) {
    if (!d->writes()) continue;  // read-only (DeepSpeed)
    CAPTURE(d->name());
    testing::TempDir out;
    const Status st = d->write(bad, out.path / "c", {});
    CHECK(st.code() == ErrorCode::kInvalidArgument);
    CHECK(st.message().find(key) != std::string::npos);
    CHECK(st.message().find("holds") != std::string::npos);
    CHECK(listing(out.path).empty());

    auto reader = open_checkpoint(src);
    REQUIRE(reader.ok());
    auto source = reader_source(**reader);
    const Status rs = write_checkpoint(*d, *source, out.path / "c", {});
    bool keeps_weights = false;
    for (const auto& [fqn, ps] : d->kept(bad).params) keeps_weights = keeps_weights || ps.entries.count(kParam);
    if (keeps_weights) {
      CHECK(rs.code() == ErrorCode::kCorrupt);
      CHECK(rs.message().find(src.string()) != std::string::npos);  // the file the bad bytes are in
      CHECK(rs.message().find(last_key) != std::string::npos);
      CHECK(listing(out.path).empty());
    } else {
      CHECK(rs.ok());  // a LibTorch optimizer archive holds no weights: the damaged ones are not read
      fs::remove_all(out.path / "c");
    }

    // Interrupted (Ctrl-C in convert) while it reads the source: stopped, nothing left.
    auto intact = open_checkpoint(dir.path / "intact");
    REQUIRE(intact.ok());
    auto from_intact = reader_source(**intact);
    request_interrupt(SIGINT);
    const Status is = write_checkpoint(*d, *from_intact, out.path / "c", {});
    clear_interrupt();
    CHECK(is.code() == ErrorCode::kCancelled);
    CHECK(listing(out.path).empty());
  }
}

TEST_CASE("recode_entry and recode_meta agree with the whole-state conversions") {
  const OptimizerState dense = larger_state();
  const QuantizeOptions q{64, 100};  // the sample state's small params stay dense
  const OptimizerState eight = *quantize_state(dense, q);
  for (const auto& [fqn, ps] : dense.params) {
    const int64_t numel = *checked_numel(ps.shape);
    for (const auto& [name, e] : ps.entries) {
      const std::string key = entry_key(fqn, name);  // clang < 16 cannot capture a structured binding
      CAPTURE(key);
      const Entry& want = eight.params.at(fqn).entries.at(name);
      const Entry m = recode_meta(name, e, numel, Recode::kQuantize, q);
      CHECK(m.encoding == want.encoding);
      CHECK(m.block_size == want.block_size);
      CHECK(m.qmap == want.qmap);
      CHECK(m.values.empty());
      auto got = recode_entry(name, e, numel, Recode::kQuantize, q, key);
      REQUIRE(got.ok());
      for (Component c : want.components()) {
        const auto a = got->buffer(c).span(), b = want.buffer(c).span();
        CHECK(std::equal(a.begin(), a.end(), b.begin(), b.end()));
      }
    }
  }
  CHECK(check_quantize_options({0, 1}).code() == ErrorCode::kInvalidArgument);
  auto source = memory_source(dense);
  auto recoded = recoded_source(*source, Recode::kQuantize, {0, 1});
  CHECK(recoded->load("big.weight", kExpAvg).status().code() == ErrorCode::kInvalidArgument);
  CHECK(source->load("big.weight", "nope").status().code() == ErrorCode::kNotFound);
}
