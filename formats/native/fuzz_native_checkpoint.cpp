// Fuzz target for a whole native checkpoint: the manifest's promises against the data files (sizes,
// chunk offsets, checksums, 8-bit codes and scales, ranks). A real 2-rank checkpoint with dense and
// 8-bit entries is written once; each input replaces its manifest (re-signed, so the checks behind the
// checksum are reached) or, in the bounded run, also damages a data file. Open, validate, hash and a
// full read must give a result or an error naming the file; never a crash, a hang or an unbounded
// allocation. libFuzzer entry point (the input is the manifest text) plus a bounded mutation run
// (CTest: fuzz.native_checkpoint). `--print-seed` prints the manifest (testdata/checkpoint/manifest.json).
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_mutate.h"
#include "native_manifest.h"
#include "optstate/checkpoint.h"
#include "optstate/hash.h"
#include "optstate/transform.h"
#include "optstate/validate.h"
#include "registry.h"

namespace fs = std::filesystem;
using namespace optstate;

namespace {

struct Fixture {
  fs::path root;      // the pristine checkpoint
  fs::path work;      // the copy each input is tried in
  std::string manifest;
  std::vector<std::pair<fs::path, std::string>> data;  // relative path, bytes
};

std::string read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

void write_file(const fs::path& p, std::string_view bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

OptimizerState seed_state() {
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
      const float scale = name == "exp_avg_sq" ? 1e-4f : -1e-2f;  // second moments are non-negative
      std::vector<float> v(static_cast<size_t>(n));
      for (size_t i = 0; i < v.size(); ++i) v[i] = scale * static_cast<float>((i * 37) % 101 - (name == "exp_avg") * 50);
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
  return *quantize_state(st, q);  // a.weight gets 8-bit moments, a.bias stays dense
}

const Fixture& fixture() {
  static const Fixture f = [] {
    Fixture x;
    const fs::path base = fs::temp_directory_path() / ("optstate-fuzz-native-" + std::to_string(::getpid()));
    fs::remove_all(base);
    fs::create_directories(base);
    x.root = base / "seed";
    x.work = base / "work";
    WriteOptions wo;
    wo.world_size = 2;
    if (!find_format("native")->write(seed_state(), x.root, wo).ok()) std::abort();
    x.manifest = read_file(x.root / native::kManifestName);
    for (const auto& e : fs::recursive_directory_iterator(x.root))
      if (e.is_regular_file() && e.path().filename() != native::kManifestName)
        x.data.emplace_back(fs::relative(e.path(), x.root), read_file(e.path()));
    return x;
  }();
  return f;
}

// Puts the pristine data files and `manifest` in the work directory and runs every reader path.
// Returns whether the checkpoint opened.
bool try_checkpoint(std::string_view manifest, const std::vector<std::pair<fs::path, std::string>>& data) {
  const Fixture& f = fixture();
  fs::remove_all(f.work);
  fs::create_directories(f.work / "data");
  write_file(f.work / native::kManifestName, manifest);
  for (const auto& [rel, bytes] : data) write_file(f.work / rel, bytes);
  const FormatDriver* d = find_format("native");
  (void)validate_checkpoint(f.work, [d](const fs::path& p) { return d->open(p); });
  auto r = d->open(f.work);
  if (!r.ok()) return false;
  (void)hash_checkpoint(**r);
  (void)load_all(**r);
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string raw(reinterpret_cast<const char*>(data), size);
  auto signed_input = native::resign_manifest_for_tests(raw);
  try_checkpoint(signed_input ? *signed_input : raw, fixture().data);
  return 0;
}

#ifndef OPTSTATE_LIBFUZZER
int main(int argc, char** argv) {
  const Fixture& f = fixture();
  if (argc > 1 && std::string_view(argv[1]) == "--print-seed") {  // makes testdata/checkpoint/manifest.json
    std::fwrite(f.manifest.data(), 1, f.manifest.size(), stdout);
    fs::remove_all(f.root.parent_path());
    return 0;
  }
  const long iterations = argc > 1 ? std::atol(argv[1]) : 500;
  std::mt19937_64 rng(argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1);
  long opened = 0;
  for (long i = 0; i < iterations; ++i) {
    std::string manifest = f.manifest;
    auto data = f.data;
    if (i % 3 != 2) {  // the manifest, re-signed: lying offsets, sizes, shapes, block sizes
      optstate::fuzz::mutate(manifest, rng, optstate::fuzz::kJsonAlphabet);
      if (auto s = native::resign_manifest_for_tests(manifest)) manifest = *s;
    } else {  // a data file: flipped bits, cuts, truncation
      auto& bytes = data[rng() % data.size()].second;
      optstate::fuzz::mutate(bytes, rng, "");
    }
    opened += try_checkpoint(manifest, data);
  }
  fs::remove_all(f.root.parent_path());
  std::printf("fuzz.native_checkpoint: %ld inputs, %ld opened, no crash\n", iterations, opened);
  return 0;
}
#endif
