// HDF5 driver: damaged files give errors naming the file and dataset; never a crash.
#include <doctest/doctest.h>

#include <cstring>
#include <fstream>

#include "optstate/checkpoint.h"
#include "optstate/hash.h"
#include "registry.h"
#include "test_helpers.h"

using namespace optstate;
namespace fs = std::filesystem;

TEST_CASE("hdf5: a flipped data byte fails its chunk's fletcher32; truncation and foreign files are refused") {
  const FormatDriver* d = find_format("hdf5");
  if (!d) return;  // built without OPTSTATE_WITH_HDF5
  testing::TempDir dir;
  const auto good = dir.path / "good.h5";
  REQUIRE(d->write(testing::sample_state(), good, {}).ok());
  std::string bytes = testing::read_file(good);
  SUBCASE("flipped bit in exp_avg's data") {
    const float v[3] = {0.1f, -0.2f, 0.3f};
    std::string pattern(reinterpret_cast<const char*>(v), sizeof v);
    const auto at = bytes.find(pattern);
    REQUIRE(at != std::string::npos);
    bytes[at + 5] ^= 0x10;
    const auto bad = dir.path / "flipped.h5";
    std::ofstream(bad, std::ios::binary) << bytes;
    auto r = d->open(bad);
    REQUIRE(r.ok());
    auto h = hash_checkpoint(**r);
    REQUIRE(!h.ok());
    CHECK(h.status().message().find("flipped.h5") != std::string::npos);
    CHECK(h.status().message().find("/layers.0.weight/exp_avg") != std::string::npos);
    CHECK(h.status().message().find("fletcher32") != std::string::npos);
  }
  SUBCASE("truncated") {
    const auto bad = dir.path / "short.h5";
    std::ofstream(bad, std::ios::binary) << bytes.substr(0, bytes.size() / 2);
    auto r = d->open(bad);
    if (r.ok()) CHECK(!hash_checkpoint(**r).ok());  // metadata may survive; the data cannot
    else CHECK(r.status().message().find("short.h5") != std::string::npos);
  }
  SUBCASE("not HDF5 at all") {
    const auto bad = dir.path / "text.h5";
    std::ofstream(bad) << "hello";
    CHECK(!d->sniff(bad));
    auto r = d->open(bad);
    REQUIRE(!r.ok());
    CHECK(r.status().message().find("no signature") != std::string::npos);
  }
}

// Each param is a group and each entry a chunked dataset. HDF5's 1.8 file format indexes a
// dataset's chunks with a version-1 B-tree, whose node is allocated at its full size (~2.5 KiB)
// even for one chunk; the 1.10 format keeps a single chunk's address in the dataset's header.
TEST_CASE("hdf5: small params cost about a kilobyte each, not a B-tree per dataset") {
  const FormatDriver* d = find_format("hdf5");
  if (!d) return;
  OptimizerState s;
  s.kind = "adamw";
  ParamGroup g;
  constexpr int kParams = 1000;
  for (int i = 0; i < kParams; ++i) {
    const std::string fqn = "layers." + std::to_string(i) + ".weight";
    g.params.push_back(fqn);
    ParamState ps;
    ps.shape = {4};
    ps.step = 1;
    Entry m, v;
    m.values = testing::f32_buffer({0.5f, -0.5f, 0.25f, float(i)});
    v.values = testing::f32_buffer({0.25f, 0.25f, 0.0625f, float(i) * float(i)});
    ps.entries = {{kExpAvg, m}, {kExpAvgSq, v}};
    s.params.emplace(fqn, std::move(ps));
  }
  s.groups = {g};
  testing::TempDir dir;
  const auto file = dir.path / "small.h5";
  REQUIRE(d->write(s, file, {}).ok());
  const auto size = fs::file_size(file);
  CHECK(size < uintmax_t{kParams} * 1536);  // the 1.8 format's B-trees: ~5,400 bytes a param
  auto r = d->open(file);
  REQUIRE(r.ok());
  auto h = hash_checkpoint(**r);
  REQUIRE(h.ok());
  float got[4] = {};
  REQUIRE((*r)->read_range("layers.999.weight", std::string(kExpAvgSq), Component::kValues, 0, 4,
                           std::as_writable_bytes(std::span(got)))
              .ok());
  CHECK(got[3] == 999.0f * 999.0f);
}

// Files optstate wrote before it moved to the 1.10 file format (bounds v18..latest, object times
// recorded) still read: testdata/adamw8bit_v18.h5 is safetensors/testdata/adamw8bit.safetensors
// converted by that writer, and holds the same state, checksums and all.
// testdata/h5py_edited.h5: safetensors/testdata/adamw8bit.safetensors converted to HDF5, then in
// h5py: f.attrs["optstate"] = f.attrs["optstate"].decode(); f.attrs["format"] = "optstate-hdf5";
// v = f["bias/exp_avg"][...]; del f["bias/exp_avg"]; f["bias/exp_avg"] = v.
namespace {
// `reader` holds the state of formats/safetensors/testdata/adamw8bit.safetensors, which the HDF5
// fixtures were converted from: the same root hash of the stored encodings and of the values.
void check_same_state_as_safetensors_fixture(CheckpointReader& reader) {
  const FormatDriver* st = find_format("safetensors");
  REQUIRE(st);
  auto source = st->open(fs::path(OPTSTATE_SOURCE_DIR) / "formats/safetensors/testdata/adamw8bit.safetensors");
  REQUIRE(source.ok());
  for (bool values : {false, true}) {
    HashOptions o;
    o.values = values;
    auto a = hash_checkpoint(reader, o);
    auto b = hash_checkpoint(**source, o);
    REQUIRE(a.ok());
    REQUIRE(b.ok());
    CHECK(a->root == b->root);
  }
}
}  // namespace

TEST_CASE("hdf5: a file h5py edited (vlen UTF-8 attributes, a dataset without fletcher32) reads the same") {
  const FormatDriver* d = find_format("hdf5");
  if (!d) return;
  const fs::path root(OPTSTATE_SOURCE_DIR);
  auto edited = d->open(root / "formats/hdf5/testdata/h5py_edited.h5");
  REQUIRE(edited.ok());
  CHECK_FALSE((*edited)->checksummed());
  CHECK((*edited)->unchecked() == "1 of 8 datasets has no fletcher32 checksum, the first '/bias/exp_avg'");
  check_same_state_as_safetensors_fixture(**edited);
}

TEST_CASE("hdf5: a file in the 1.8 file format, as optstate wrote it before, reads as the same state") {
  const FormatDriver* d = find_format("hdf5");
  if (!d) return;
  const fs::path root(OPTSTATE_SOURCE_DIR);
  auto old_file = d->open(root / "formats/hdf5/testdata/adamw8bit_v18.h5");
  REQUIRE(old_file.ok());
  CHECK((*old_file)->checksummed());
  check_same_state_as_safetensors_fixture(**old_file);
}
