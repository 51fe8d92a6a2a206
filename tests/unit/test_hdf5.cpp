// HDF5 driver: damaged files give errors naming the file and dataset; never a crash.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <future>
#include <memory>
#include <set>
#include <thread>
#include <tuple>

#include "optstate/checkpoint.h"
#include "optstate/hash.h"
#include "hdf5/hdf5_layout.h"
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
  // The same rebuilt by h5py in v110: gzip, shuffle, resizable chunks, attributes and links past 8
  // (dense storage), ten unrelated groups (testdata/make_h5py_v110_dense.py).
  auto dense = d->open(root / "formats/hdf5/testdata/h5py_v110_dense.h5");
  REQUIRE_MESSAGE(dense.ok(), dense.status().message());
  check_same_state_as_safetensors_fixture(**dense);
  // In v110 with paged file space (a file space info message in the superblock extension) and the
  // float32 datasets and a root attribute of committed datatypes (shared messages naming them), root
  // attributes in dense storage, one a huge heap object (testdata/make_h5py_paged_committed.py).
  auto committed = d->open(root / "formats/hdf5/testdata/h5py_paged_committed.h5");
  REQUIRE_MESSAGE(committed.ok(), committed.status().message());
  check_same_state_as_safetensors_fixture(**committed);
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

// testdata/h5py_earliest.h5: safetensors/testdata/adamw8bit.safetensors converted to HDF5, then
// copied by h5py (HDF5 2.0.0) into a file made with libver='earliest' (superblock 0, version 1
// object headers), str attributes as h5py stores them (variable-length UTF-8), datasets chunked
// with fletcher32 as they were.
TEST_CASE("hdf5: a file h5py wrote in the earliest file format (superblock 0, v1 headers) reads the same") {
  const FormatDriver* d = find_format("hdf5");
  if (!d) return;
  auto r = d->open(fs::path(OPTSTATE_SOURCE_DIR) / "formats/hdf5/testdata/h5py_earliest.h5");
  REQUIRE(r.ok());
  CHECK((*r)->checksummed());
  check_same_state_as_safetensors_fixture(**r);
}

namespace {
std::vector<std::byte> file_bytes(const std::string& name) {
  const std::string s = testing::read_file(fs::path(OPTSTATE_SOURCE_DIR) / "formats/hdf5/testdata" / name);
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  return std::vector<std::byte>(p, p + s.size());
}
hdf5::ReadAt read_from(const std::vector<std::byte>& b) {
  return [&b](uint64_t at, std::span<std::byte> out) -> Status {
    if (at > b.size() || out.size() > b.size() - at) return corrupt("past the end");
    std::memcpy(out.data(), b.data() + at, out.size());
    return Status::Ok();
  };
}
void put(std::vector<std::byte>& b, size_t at, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) b[at + static_cast<size_t>(i)] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}
// A 4096-byte collection: object 1 ("hello", 5 bytes padded to 8) at 16, then free space (index 0)
// to the end.
std::vector<std::byte> small_collection() {
  std::vector<std::byte> c(4096);
  std::memcpy(c.data(), "GCOL\x01\0\0\0", 8);
  put(c, 8, 4096, 8);
  put(c, 16, 1, 2);
  put(c, 18, 1, 2);
  put(c, 24, 5, 8);
  std::memcpy(c.data() + 32, "hello", 5);
  put(c, 40, 0, 2);
  put(c, 48, 4096 - 40, 8);
  return c;
}
std::string error_of(const Status& s) { return s.ok() ? "ok" : s.message(); }
}  // namespace

TEST_CASE("hdf5 layout: the root's variable-length string attributes and their collection, as h5py stores them") {
  struct Case {
    const char* file;
    int superblock;
    uint64_t root;
    std::vector<std::string> names;  // the root's variable-length string attributes
  };
  // h5py_edited: superblock 3, a version 2 object header holding version 1 attribute messages, two
  // attributes h5py rewrote; h5py_earliest: superblock 0 (the root's symbol table entry), a version
  // 1 object header, every str attribute h5py's.
  for (const Case& k : {Case{"h5py_edited.h5", 3, 48, {"optstate", "format"}},
                        Case{"h5py_earliest.h5", 0, 96, {"format", "optimizer", "optstate"}}}) {
    CAPTURE(k.file);
    const auto b = file_bytes(k.file);
    auto sb = hdf5::parse_superblock(b, k.file);
    REQUIRE(sb.ok());
    CHECK(sb->version == k.superblock);
    CHECK(sb->offset_size == 8);
    CHECK(sb->length_size == 8);
    CHECK(sb->root_header == k.root);
    auto found = hdf5::find_vlen_string_attributes(read_from(b), *sb, sb->root_header, k.file);
    REQUIRE(found.ok());
    std::vector<std::string> names;
    for (const auto& [name, ref] : *found) {
      names.push_back(name);
      const uint64_t length = name == "optstate" ? 679 : name == "format" ? 13 : 9;  // "adamw8bit"
      CHECK(ref.length == length);
      auto size = hdf5::parse_collection_size(std::span(b).subspan(ref.collection, 16), 8, k.file);
      REQUIRE(size.ok());
      CHECK(error_of(hdf5::check_collection(std::span(b).subspan(ref.collection, *size), 8, ref, k.file)) == "ok");
      // The string the collection holds is the attribute's: the format tag.
      if (name == "format") {
        const auto* text = reinterpret_cast<const char*>(b.data() + ref.collection + 16);
        bool seen = false;
        for (size_t at = 0; at + 13 <= *size - 16 && !seen; ++at) seen = std::string_view(text + at, 13) == "optstate-hdf5";
        CHECK(seen);
      }
    }
    CHECK(names == k.names);
  }
  // optstate writes fixed-length strings: no variable-length one is found.
  const auto b = file_bytes("adamw8bit_v18.h5");
  auto sb = hdf5::parse_superblock(b, "v18");
  REQUIRE(sb.ok());
  auto refs = hdf5::find_vlen_string_attributes(read_from(b), *sb, sb->root_header, "v18");
  REQUIRE(refs.ok());
  CHECK(refs->empty());
}

TEST_CASE("hdf5 layout: a collection libhdf5's loader would loop on or read past is refused") {
  const hdf5::VlenRef hello{5, 1, 1};
  CHECK(error_of(hdf5::check_collection(small_collection(), 8, hello, "c")) == "ok");
  auto c = small_collection();
  SUBCASE("free space of size 0: libhdf5 steps by 0 forever") {
    put(c, 48, 0, 8);
    CHECK(error_of(hdf5::check_collection(c, 8, hello, "c")).find("(index 0, free space) has size 0") !=
          std::string::npos);
  }
  SUBCASE("an object past the end") {
    put(c, 24, 5000, 8);
    CHECK(error_of(hdf5::check_collection(c, 8, {5000, 1, 1}, "c")).find("runs past") != std::string::npos);
    put(c, 24, ~uint64_t{0}, 8);  // a size that overflows the step
    CHECK(error_of(hdf5::check_collection(c, 8, hello, "c")).find("runs past") != std::string::npos);
  }
  SUBCASE("free space running past the end") {
    put(c, 48, 4096, 8);
    CHECK(error_of(hdf5::check_collection(c, 8, hello, "c")).find("runs past") != std::string::npos);
  }
  SUBCASE("an index twice") {
    put(c, 40, 1, 2);
    put(c, 48, 8, 8);
    CHECK(error_of(hdf5::check_collection(c, 8, hello, "c")).find("object 1 twice") != std::string::npos);
  }
  SUBCASE("no such object, or not of the value's length") {
    CHECK(error_of(hdf5::check_collection(c, 8, {5, 1, 2}, "c")).find("holds no object 2") != std::string::npos);
    CHECK(error_of(hdf5::check_collection(c, 8, {6, 1, 1}, "c")).find("holds 5 bytes, the value says 6") !=
          std::string::npos);
  }
  SUBCASE("a tail too small for an object header is free space, as libhdf5 takes it") {
    put(c, 48, 4096 - 40 - 8, 8);
    CHECK(error_of(hdf5::check_collection(c, 8, hello, "c")) == "ok");
  }
  SUBCASE("header: signature, version, size") {
    c[0] = std::byte{'X'};
    CHECK(error_of(hdf5::check_collection(c, 8, hello, "c")).find("no \"GCOL\"") != std::string::npos);
    c[0] = std::byte{'G'};
    c[4] = std::byte{2};
    CHECK(error_of(hdf5::check_collection(c, 8, hello, "c")).find("version 2") != std::string::npos);
    c[4] = std::byte{1};
    put(c, 8, 100, 8);
    CHECK(error_of(hdf5::check_collection(c, 8, hello, "c")).find("outside [4096") != std::string::npos);
    put(c, 8, 8192, 8);
    CHECK(error_of(hdf5::check_collection(c, 8, hello, "c")).find("says 8192 bytes, 4096 given") !=
          std::string::npos);
  }
}

TEST_CASE("hdf5 layout: hostile superblocks and object headers give errors") {
  auto b = file_bytes("h5py_edited.h5");
  SUBCASE("superblock") {
    b[8] = std::byte{4};
    CHECK(error_of(hdf5::parse_superblock(b, "f").status()).find("version 4") != std::string::npos);
    b[8] = std::byte{3};
    b[9] = std::byte{3};
    CHECK(error_of(hdf5::parse_superblock(b, "f").status()).find("addresses of 3 bytes") != std::string::npos);
    CHECK_FALSE(hdf5::parse_superblock(std::span(b).first(20), "f").ok());
    CHECK_FALSE(hdf5::parse_superblock(std::span(b).subspan(1), "f").ok());
  }
  SUBCASE("attribute messages whose sizes run past themselves (libhdf5 1.10 trusts them)") {
    // h5py_earliest's root (a version 1 header at 96): the `optstate` attribute message (version 1,
    // 72 bytes) at 1048: name size 9 at 1050, datatype size 20 at 1052, dataspace size 8 at 1054;
    // the name at 1056, the datatype at 1072 (its element size at 1076), the dataspace at 1096
    // (version 1, rank 0: scalar), the data (16 bytes) at 1104.
    auto e = file_bytes("h5py_earliest.h5");
    const auto refused = [&](std::vector<std::byte> bytes) {
      auto s = hdf5::parse_superblock(bytes, "f");
      REQUIRE(s.ok());
      return error_of(hdf5::find_vlen_string_attributes(read_from(bytes), *s, 96, "f").status());
    };
    REQUIRE(refused(e) == "ok");
    auto bad = e;
    put(bad, 1054, 0x8808, 2);  // what fuzz_hdf5_file made libhdf5 read past its buffer with
    CHECK(refused(bad) == "f: the object header at 96: an attribute message of 72 bytes has a name, datatype and "
                          "dataspace of 9, 20 and 34824 bytes, past its end");
    bad = e;
    bad[1064] = std::byte{'x'};  // libhdf5 copies the name up to its NUL
    CHECK(refused(bad).find("a name that does not end in its one NUL") != std::string::npos);
    bad = e;
    put(bad, 1097, 1, 1);  // rank 1: a dimension the dataspace's 8 bytes do not hold
    CHECK(refused(bad).find("a dataspace of rank 1 that its 8 bytes do not hold") != std::string::npos);
    bad = e;
    put(bad, 1076, 1000, 4);  // elements of 1000 bytes: libhdf5 would copy 1000 bytes of data
    CHECK(refused(bad).find("holds 1 elements of 1000 bytes in 16 bytes") != std::string::npos);
  }
  hdf5::Superblock sb;
  SUBCASE("a continuation chunk named twice (a loop)") {
    // A version 1 header at 0 whose one message continues the header at its own first chunk.
    std::vector<std::byte> h(64);
    put(h, 0, 1, 1);
    put(h, 8, 24, 4);
    put(h, 16, 0x10, 2);  // continuation message: 16 bytes
    put(h, 18, 16, 2);
    put(h, 24, 16, 8);  // at 16, 24 bytes: this chunk again
    put(h, 32, 24, 8);
    CHECK(error_of(hdf5::find_vlen_string_attributes(read_from(h), sb, 0, "f").status())
              .find("continuation chunk at 16 is named twice") != std::string::npos);
    put(h, 18, 40, 2);  // a message running past its chunk
    CHECK(error_of(hdf5::find_vlen_string_attributes(read_from(h), sb, 0, "f").status())
              .find("runs past its chunk's end") != std::string::npos);
    put(h, 0, 7, 1);
    CHECK(error_of(hdf5::find_vlen_string_attributes(read_from(h), sb, 0, "f").status())
              .find("not an object header") != std::string::npos);
  }
  SUBCASE("a chunk over the cap, or past the file's end") {
    // h5py_edited's root header at 48: "OHDR", version 2, flags 0x01 (the first chunk's size in 2
    // bytes, at 54).
    REQUIRE(b[53] == std::byte{0x01});
    put(b, 54, 0xffff, 2);
    auto s = hdf5::parse_superblock(b, "f");
    REQUIRE(s.ok());
    CHECK(error_of(hdf5::find_vlen_string_attributes(read_from(b), *s, 48, "f").status()) ==
          "f: the object header at 48: past the end");
    std::vector<std::byte> h(64);  // version 1: the size is 4 bytes
    put(h, 0, 1, 1);
    put(h, 8, 0xffffffff, 4);
    CHECK(error_of(hdf5::find_vlen_string_attributes(read_from(h), sb, 0, "f").status())
              .find("a chunk of 4294967295 bytes is over the 16 MiB") != std::string::npos);
  }
}

TEST_CASE("hdf5: a global heap collection libhdf5 would loop on is refused before libhdf5 reads it") {
  // testdata/hang_global_heap.h5: h5py_edited.h5 with 4 bytes of the collection changed (object 2,
  // the format tag, claims 118 bytes, so the walk lands on zeros: free space of size 0). libhdf5
  // 1.10.8's H5Aread of an attribute stored there never returned; a watchdog ends the run if the
  // check is gone.
  const FormatDriver* d = find_format("hdf5");
  if (!d) return;
  const fs::path path = fs::path(OPTSTATE_SOURCE_DIR) / "formats/hdf5/testdata/hang_global_heap.h5";
  auto done = std::make_shared<std::promise<Status>>();
  auto result = done->get_future();
  std::thread([d, path, done] { done->set_value(d->open(path).status()); }).detach();
  if (result.wait_for(std::chrono::seconds(120)) != std::future_status::ready) {
    std::fprintf(stderr, "hdf5: opening %s did not return in 120 s (libhdf5's loop)\n", path.c_str());
    std::_Exit(1);
  }
  const Status st = result.get();
  CHECK(st.code() == ErrorCode::kCorrupt);
  CHECK(st.message().find(path.string()) != std::string::npos);
  // The root's header holds `optstate` first: its walk steps past object 2 (118 bytes, padded) onto
  // the zeros.
  CHECK(st.message().find("attribute 'optstate': its global heap collection at 6829: the global heap collection's "
                          "object at offset 848 (index 0, free space) has size 0") != std::string::npos);
}

namespace {
// formats/hdf5/testdata/`fixture` with bytes changed (offset, the byte there, the byte written),
// written under `dir`: the file a test opens.
fs::path write_changed(const testing::TempDir& dir, const std::string& fixture,
                       std::initializer_list<std::tuple<size_t, char, char>> changes) {
  std::string bytes = testing::read_file(fs::path(OPTSTATE_SOURCE_DIR) / "formats/hdf5/testdata" / fixture);
  for (const auto& [at, was, now] : changes) {
    REQUIRE(bytes.at(at) == was);
    bytes[at] = now;
  }
  const fs::path path = dir.path / ("changed_" + fixture);
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}
}  // namespace

TEST_CASE("hdf5: a chunk larger than its dataset's fixed shape is refused before libhdf5 reads it") {
  // h5py_earliest.h5 with one byte of /weight/exp_avg/codes' layout message changed (at 21184: its
  // chunk's second dimension 3 -> 16387), as fuzz_hdf5_file found it: libhdf5 1.10.8 opened the
  // dataset and its H5Dread read freed memory (under ASan).
  const FormatDriver* d = find_format("hdf5");
  if (!d) return;
  testing::TempDir dir;
  // The chunk's dimensions 2, 3 (u32) at 21179 and 21183.
  const auto bad = write_changed(dir, "h5py_earliest.h5", {{21183, '\x03', '\x03'}, {21184, '\0', '\x40'}});
  auto r = d->open(bad);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().message() == bad.string() + ": dataset '/weight/exp_avg/codes' of shape [2, 3] has chunks of [2, "
                                               "16387], larger than the dataset can be");
}

TEST_CASE("hdf5 layout: data layout messages of every version as written; a chunk dimension of 0 is refused") {
  // Every object header of each file: its datasets' layout messages (h5py's earliest format and
  // optstate's 1.8-format file: version 3; optstate's 1.10 format: version 4) pass, one per dataset.
  std::vector<std::pair<std::string, std::vector<std::byte>>> files = {
      {"h5py_earliest.h5", file_bytes("h5py_earliest.h5")}, {"adamw8bit_v18.h5", file_bytes("adamw8bit_v18.h5")}};
  if (const FormatDriver* d = find_format("hdf5")) {
    testing::TempDir dir;
    auto src = find_format("safetensors")->open(fs::path(OPTSTATE_SOURCE_DIR) /
                                                "formats/safetensors/testdata/adamw8bit.safetensors");
    REQUIRE(src.ok());
    auto source = reader_source(**src);
    REQUIRE(d->write(*source, dir.path / "v110.h5", {}).ok());
    const std::string s = testing::read_file(dir.path / "v110.h5");
    const auto* p = reinterpret_cast<const std::byte*>(s.data());
    files.emplace_back("v110.h5", std::vector<std::byte>(p, p + s.size()));
  }
  for (const auto& [name, b] : files) {
    const std::string& file_name = name;  // CAPTURE's lambda cannot name a structured binding (clang)
    CAPTURE(file_name);
    auto sb = hdf5::parse_superblock(b, name);
    REQUIRE(sb.ok());
    int layouts = 0;
    // v2 headers start "OHDR"; v1 headers are found from the superblock's root and the links only
    // libhdf5 follows, so for h5py_earliest the headers are the ones at the known addresses.
    std::vector<uint64_t> headers;
    for (size_t at = 0; at + 4 <= b.size(); ++at)
      if (std::memcmp(b.data() + at, "OHDR", 4) == 0) headers.push_back(at);
    if (headers.empty()) headers = {13680};  // h5py_earliest's /bias/param
    for (uint64_t h : headers) {
      auto n = hdf5::check_dataset_header(read_from(b), *sb, h, name);
      REQUIRE_MESSAGE(n.ok(), n.status().message());
      layouts += *n;
    }
    CHECK(layouts == (headers.size() == 1 ? 1 : 8));  // 8 datasets: 4 dense, 2 x (codes, absmax)
  }
  // The fuzzer's input: h5py_earliest's /bias/param layout message (version 3 at 13824) read as
  // version 2, whose fields then put a 0 among the chunk dimensions: libhdf5 1.10.8 died of SIGFPE.
  auto b = file_bytes("h5py_earliest.h5");
  REQUIRE(b[13824] == std::byte{3});
  b[13824] = std::byte{2};
  auto sb = hdf5::parse_superblock(b, "f");
  REQUIRE(sb.ok());
  CHECK(error_of(hdf5::check_dataset_header(read_from(b), *sb, 13680, "f").status()) ==
        "f: the object header at 13680: a data layout message of 24 bytes has a chunk dimension 0 of 0");
  // The message alone, each version: (version 4) flags, 3 dimensions of 2 bytes: 0 in the second.
  const auto msg = [](std::initializer_list<int> v) {
    std::vector<std::byte> m;
    for (int x : v) m.push_back(static_cast<std::byte>(x));
    return m;
  };
  // (then index type 2, implicit, and the index's 8-byte address)
  CHECK(error_of(hdf5::check_layout_message(msg({4, 2, 0, 3, 2, 5, 0, 0, 0, 1, 0, 2, 9, 9, 9, 9, 9, 9, 9, 9}), *sb,
                                            "m")) == "m: a data layout message of 20 bytes has a chunk dimension 1 of 0");
  CHECK(error_of(hdf5::check_layout_message(msg({4, 2, 0, 3, 2, 5, 0, 3, 0, 1, 0, 2, 9, 9, 9, 9, 9, 9, 9, 9}), *sb,
                                            "m")) == "ok");
  CHECK(error_of(hdf5::check_layout_message(msg({4, 2, 0, 3, 2, 5, 0, 3, 0, 1, 0, 2, 9, 9, 9}), *sb, "m")) ==
        "m: a data layout message of 15 bytes is cut short of its chunk index's address");
  // version 4, index type 5 (a version 2 B-tree): 6 bytes of parameters before the address
  CHECK(error_of(hdf5::check_layout_message(msg({4, 2, 0, 3, 1, 5, 3, 1, 5, 1, 1, 1, 1, 1, 9, 9, 9, 9, 9, 9, 9}),
                                            *sb, "m")) == "m: a data layout message of 21 bytes is cut short of its "
                                                          "chunk index's address");
  CHECK(error_of(hdf5::check_layout_message(msg({4, 2, 0, 3, 9}), *sb, "m")).find("of 9 bytes (1-8)") !=
        std::string::npos);
  CHECK(error_of(hdf5::check_layout_message(msg({4, 2, 0, 40, 1}), *sb, "m")).find("has 40 chunk dimensions") !=
        std::string::npos);
  CHECK(error_of(hdf5::check_layout_message(msg({4, 2, 0, 3, 4, 5, 0}), *sb, "m")).find("past its end") !=
        std::string::npos);
  // contiguous (version 3): an address and a size, 8 bytes each
  CHECK(error_of(hdf5::check_layout_message(msg({3, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}), *sb,
                                            "m")) == "ok");
  CHECK(error_of(hdf5::check_layout_message(msg({3, 1}), *sb, "m")) == "m: a data layout message of 2 bytes is cut short");
  // compact: the data by the size stated (version 3: u16; version 1: u32 after the dimensions)
  CHECK(error_of(hdf5::check_layout_message(msg({3, 0, 2, 0, 7, 7}), *sb, "m")) == "ok");
  CHECK(error_of(hdf5::check_layout_message(msg({3, 0, 3, 0, 7, 7}), *sb, "m")) ==
        "m: a data layout message of 6 bytes holds 3 bytes of compact data past its end");
  CHECK(error_of(hdf5::check_layout_message(msg({1, 1, 0, 0, 0, 0, 0, 0, 6, 0, 0, 0, 1, 0, 0, 0, 7}), *sb, "m")) ==
        "ok");
  CHECK(error_of(hdf5::check_layout_message(msg({1, 1, 0, 0, 0, 0, 0, 0, 6, 0, 0, 0, 2, 0, 0, 0, 7}), *sb, "m")) ==
        "m: a data layout message of 17 bytes holds 2 bytes of compact data past its end");
  CHECK(error_of(hdf5::check_layout_message(msg({1, 40, 0, 0, 0, 0, 0, 0}), *sb, "m")) ==
        "m: a data layout message of 8 bytes has 40 dimensions (at most 33)");
  // virtual: the data lies in other files
  CHECK(error_of(hdf5::check_layout_message(msg({4, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}), *sb, "m"))
            .find("is a virtual dataset's (its data lies in other files)") != std::string::npos);
  CHECK(error_of(hdf5::check_layout_message(msg({5, 2}), *sb, "m")) == "ok");  // a version 1.10 refuses
}

TEST_CASE("hdf5: a chunk dimension of 0 is refused before libhdf5 opens the dataset (it died of SIGFPE)") {
  const FormatDriver* d = find_format("hdf5");
  if (!d) return;
  testing::TempDir dir;
  // /bias/param's layout message read as version 2 (fuzz_hdf5_file's input).
  const auto bad = write_changed(dir, "h5py_earliest.h5", {{13824, '\x03', '\x02'}});
  auto r = d->open(bad);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().message() == bad.string() + ": dataset '/bias/param': the object header at 13680: a data layout "
                                               "message of 24 bytes has a chunk dimension 0 of 0");
}

TEST_CASE("hdf5: a chunk stored in fewer bytes than its fletcher32 checksum is refused before libhdf5 reads it") {
  // adamw8bit_v18.h5 with /weight/exp_avg/codes' chunk size in its B-tree record (at 11686) 10 -> 2,
  // as fuzz_hdf5_file found it: libhdf5 1.10.8's fletcher32 filter took 4 off 2 and read on (SIGSEGV).
  const FormatDriver* d = find_format("hdf5");
  if (!d) return;
  testing::TempDir dir;
  const auto bad = write_changed(dir, "adamw8bit_v18.h5", {{11686, '\x0a', '\x02'}});
  auto r = d->open(bad);  // opening reads no chunk
  REQUIRE(r.ok());
  std::vector<std::byte> out(6);
  const Status st = (*r)->read_range("weight", "exp_avg", Component::kCodes, 0, 6, out);
  CHECK(st.message() == bad.string() + ": dataset '/weight/exp_avg/codes': the chunk at [0, 0] is stored in 2 bytes, "
                                       "fewer than its fletcher32 checksum's 4");
  CHECK((*r)->read_range("weight", "exp_avg", Component::kAbsmax, 0, 1, std::span(out).first(4)).ok());
}

TEST_CASE("hdf5: a root attribute's datatype whose parts run past its message is refused before libhdf5 decodes it") {
  // h5py_earliest.h5 with the `format` attribute's datatype class byte (at 992) 0x19 -> 0x18: a
  // variable-length string read as an enumeration, whose member names libhdf5 1.10.8 copied with
  // strdup past the message (fuzz_hdf5_file, under ASan).
  const FormatDriver* d = find_format("hdf5");
  if (!d) return;
  testing::TempDir dir;
  const auto bad = write_changed(dir, "h5py_earliest.h5", {{992, '\x19', '\x18'}});
  auto r = d->open(bad);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().message() == bad.string() + ": the object header at 96: an attribute message of 72 bytes has a "
                                               "datatype (class 8) whose parts run past its 20 bytes");
}

TEST_CASE("hdf5: a compact or contiguous dataset stored in other than its elements' bytes is refused at open") {
  // h5py_edited.h5's /bias/exp_avg (contiguous, 8 bytes; its layout message, version 3, at 11029)
  // made compact in 0 bytes, as fuzz_hdf5_file found it: libhdf5 1.10.8 read 8 bytes from a null
  // pointer (SIGSEGV in H5Dread).
  const FormatDriver* d = find_format("hdf5");
  if (!d) return;
  testing::TempDir dir;
  // Version 3 at 11029; class compact, and the next 2 bytes (its size) 0.
  const auto bad = write_changed(dir, "h5py_edited.h5", {{11029, '\x03', '\x03'}, {11030, '\x01', '\0'}, {11032, '\x10', '\0'}});
  auto r = d->open(bad);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().message() == bad.string() + ": dataset '/bias/exp_avg' of 8 bytes is stored compact in 0 bytes");
}

TEST_CASE("hdf5 layout: filter pipeline, fill value and datatype messages libhdf5 would read past are refused") {
  const auto msg = [](std::initializer_list<int> v) {
    std::vector<std::byte> m;
    for (int x : v) m.push_back(static_cast<std::byte>(x));
    return m;
  };
  const auto pline = [](const std::vector<std::byte>& m) { return error_of(hdf5::check_filter_pipeline_message(m, "m")); };
  // Version 1, as h5py_earliest.h5 holds it: fletcher32 (id 3), a name of 16 bytes, no values.
  const auto fletcher = [&](int filters, int name_length, int values) {
    auto m = msg({1, filters, 0, 0, 0, 0, 0, 0, 3, 0, name_length, 0, 0, 0, values, 0});
    for (char c : std::string_view("fletcher32\0\0\0\0\0\0", 16)) m.push_back(static_cast<std::byte>(c));
    return m;
  };
  CHECK(pline(fletcher(1, 16, 0)) == "ok");
  CHECK(pline(fletcher(0x11, 16, 0)) == "m: a filter pipeline message of 32 bytes has filter 1 past its end");
  CHECK(pline(fletcher(33, 16, 0)) == "m: a filter pipeline message of 32 bytes has 33 filters (at most 32)");
  CHECK(pline(fletcher(1, 12, 0)) == "m: a filter pipeline message of 32 bytes has filter 0 with a name of 12 bytes "
                                     "(a multiple of 8)");
  CHECK(pline(fletcher(1, 24, 0)) == "m: a filter pipeline message of 32 bytes has filter 0's name past its end");
  CHECK(pline(fletcher(1, 16, 1)) == "m: a filter pipeline message of 32 bytes has filter 0's 1 values past its end");
  auto unterminated = fletcher(1, 8, 0);  // "fletcher" with no NUL in its 8 bytes
  unterminated.resize(24);
  CHECK(pline(unterminated) == "m: a filter pipeline message of 24 bytes has filter 0 whose name of 8 bytes has no NUL");
  // Version 2: a predefined filter (id < 256) has no name length; deflate with its one value.
  CHECK(pline(msg({2, 1, 1, 0, 0, 0, 1, 0, 4, 0, 0, 0})) == "ok");
  CHECK(pline(msg({2, 1, 1, 0, 0, 0, 2, 0, 4, 0, 0, 0})) ==
        "m: a filter pipeline message of 12 bytes has filter 0's 2 values past its end");
  CHECK(pline(msg({3, 1})) == "ok");  // a version libhdf5 refuses itself
  // Shuffle, then scale-offset (id 6, as h5py writes scaleoffset=): refused, as is N-bit (id 5).
  CHECK(pline(msg({2, 2, 2, 0, 0, 0, 1, 0, 4, 0, 0, 0, 6, 0, 0, 0, 0, 0})) ==
        "m: a filter pipeline message of 18 bytes has filter 1 (scale-offset), whose decompression libhdf5 1.10 does "
        "not bound: not read");
  CHECK(pline(msg({2, 1, 5, 0, 0, 0, 0, 0})).find("has filter 0 (N-bit)") != std::string::npos);

  const auto fill = [](const std::vector<std::byte>& m, bool old = false) {
    auto r = hdf5::fill_value_size(m, old, "m");
    return r.ok() ? std::to_string(*r) : r.status().message();
  };
  CHECK(fill(msg({2, 2, 2, 1, 4, 0, 0, 0, 0, 0, 0, 0})) == "4");      // version 2, defined: 4 bytes
  CHECK(fill(msg({2, 2, 2, 0})) == "-1");                            // not defined: no size
  CHECK(fill(msg({2, 2, 2, 1, 8, 0, 0, 0, 0, 0, 0, 0})) == "m: a fill value message of 12 bytes holds a value of 8 "
                                                                 "bytes past its end");
  CHECK(fill(msg({1, 2, 2, 0, 0, 0, 0, 0})) == "0");                 // version 1 always has a size
  CHECK(fill(msg({1, 2, 2, 0})) == "m: a fill value message of 4 bytes is cut short");
  CHECK(fill(msg({3, 0x20, 4, 0, 0, 0, 1, 2, 3, 4})) == "4");
  CHECK(fill(msg({3, 0x20, 5, 0, 0, 0, 1, 2, 3, 4})) ==
        "m: a fill value message of 10 bytes holds a value of 5 bytes past its end");
  CHECK(fill(msg({3, 0x0a})) == "-1");
  CHECK(fill(msg({8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}), true) == "8");  // the old message: size, value
  CHECK(fill(msg({9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}), true) ==
        "m: a fill value message of 12 bytes holds a value of 9 bytes past its end");

  // A float32 datatype (class 1, version 1: 8 bytes, then 12 of properties), and cut short.
  const auto f32 = msg({0x11, 0x20, 0x1f, 0, 4, 0, 0, 0, 0, 0, 0x20, 0, 0x17, 8, 0, 0x17, 0x7f, 0, 0, 0});
  CHECK(error_of(hdf5::check_datatype_message(f32, "m")) == "ok");
  CHECK(error_of(hdf5::check_datatype_message(std::span(f32).first(12), "m")) ==
        "m: a datatype message of 12 bytes (class 1) has parts that run past its end");
}

namespace {
// A version 1 object header holding `messages` (type, bytes), at address 0 of its own bytes.
struct HeaderMessage {
  int type = 0;
  std::vector<std::byte> body;
  int flags = 0;  // 2: shared
};
std::vector<std::byte> v1_header(const std::vector<HeaderMessage>& messages) {
  std::vector<std::byte> area;
  for (const auto& [type, body, flags] : messages) {
    const size_t size = (body.size() + 7) / 8 * 8;
    for (int x : {type & 0xff, type >> 8, static_cast<int>(size & 0xff), static_cast<int>(size >> 8), flags, 0, 0, 0})
      area.push_back(static_cast<std::byte>(x));
    area.insert(area.end(), body.begin(), body.end());
    area.resize(area.size() + size - body.size());
  }
  std::vector<std::byte> h(16 + area.size());  // version 1, messages, refcount 1, chunk size
  h[0] = std::byte{1};
  h[2] = static_cast<std::byte>(messages.size());
  h[4] = std::byte{1};
  h[8] = static_cast<std::byte>(area.size() & 0xff);
  h[9] = static_cast<std::byte>(area.size() >> 8);
  std::copy(area.begin(), area.end(), h.begin() + 16);
  return h;
}
std::vector<std::byte> msg(std::initializer_list<int> v) {
  std::vector<std::byte> m;
  for (int x : v) m.push_back(static_cast<std::byte>(x));
  return m;
}
// A dataset's messages: a dataspace of [6], a little-endian float32, a contiguous layout of 24 bytes.
const std::vector<std::byte> kSpace6 = msg({1, 1, 0, 0, 0, 0, 0, 0, 6, 0, 0, 0, 0, 0, 0, 0});
const std::vector<std::byte> kF32 = msg({0x11, 0x20, 0x1f, 0, 4, 0, 0, 0, 0, 0, 0x20, 0, 0x17, 8, 0, 0x17, 0x7f, 0, 0, 0});
const std::vector<std::byte> kContiguous24 = msg({3, 1, 0, 8, 0, 0, 0, 0, 0, 0, 24, 0, 0, 0, 0, 0, 0, 0});
}  // namespace

TEST_CASE("hdf5 layout: a dataset header: its messages are checked; data kept in other files is refused") {
  hdf5::Superblock sb;
  const auto& space = kSpace6;
  const auto& f32 = kF32;
  const auto& contiguous = kContiguous24;
  const auto check = [&](const std::vector<HeaderMessage>& messages) {
    const auto h = v1_header(messages);
    auto r = hdf5::check_dataset_header(read_from(h), sb, 0, "d");
    return r.ok() ? std::to_string(*r) : r.status().message();
  };
  CHECK(check({{1, space}, {3, f32}, {5, msg({2, 2, 2, 1, 4, 0, 0, 0, 0, 0, 0, 0})}, {8, contiguous}}) == "1");
  // A fill value of other than the element's size (libhdf5 fills unwritten elements from it).
  CHECK(check({{1, space}, {3, f32}, {5, msg({2, 2, 2, 1, 2, 0, 0, 0, 0, 0})}, {8, contiguous}}) ==
        "d: the object header at 0: a fill value of 2 bytes for elements of 4 bytes");
  // An external file list (a local heap of file names, offsets and sizes): another file's bytes.
  CHECK(check({{1, space}, {3, f32}, {7, msg({1, 0, 0, 0, 1, 0, 1, 0, 9, 0, 0, 0, 0, 0, 0, 0})}, {8, contiguous}})
            .find("d: the object header at 0: the dataset's data is stored in external files") == 0);
  // A dataspace of rank 2 in 16 bytes (its second dimension past the end).
  CHECK(check({{1, msg({1, 2, 0, 0, 0, 0, 0, 0, 6, 0, 0, 0, 0, 0, 0, 0})}, {8, contiguous}}) ==
        "d: the object header at 0: a dataspace message of 16 bytes has a dataspace of rank 2 that its 16 bytes do "
        "not hold");
  // Version 1 with permutation indices (flags & 2): a third list of dimensions.
  CHECK(check({{1, msg({1, 1, 2, 0, 0, 0, 0, 0, 6, 0, 0, 0, 0, 0, 0, 0})}, {8, contiguous}}).find("rank 1") !=
        std::string::npos);
  CHECK(check({{3, std::vector<std::byte>(f32.begin(), f32.begin() + 8)}}) ==
        "d: the object header at 0: a datatype message of 8 bytes (class 1) has parts that run past its end");
}

TEST_CASE("hdf5 layout: shared messages: a committed datatype is checked where it is; others are refused") {
  hdf5::Superblock sb;
  const auto& space = kSpace6;
  const auto& f32 = kF32;
  const auto& contiguous = kContiguous24;
  const auto shared_at = [&](int version, uint64_t address) {  // a shared message: versions 2 and 3 alike
    auto m = msg({version, 2, 0, 0, 0, 0, 0, 0, 0, 0});
    for (int i = 0; i < 8; ++i) m[2 + static_cast<size_t>(i)] = static_cast<std::byte>((address >> (8 * i)) & 0xff);
    return m;
  };
  // The dataset's header at 0 (96 bytes), a committed datatype's header after it.
  const auto file = [&](const std::vector<HeaderMessage>& dataset, const std::vector<HeaderMessage>& committed) {
    auto b = v1_header(dataset);
    const auto c = v1_header(committed);
    b.insert(b.end(), c.begin(), c.end());
    return b;
  };
  const auto check = [&](const std::vector<std::byte>& b) {
    auto r = hdf5::check_dataset_header(read_from(b), sb, 0, "d");
    return r.ok() ? std::to_string(*r) : r.status().message();
  };
  const std::vector<HeaderMessage> dataset = {{1, space}, {3, shared_at(3, 96), 2}, {8, contiguous}};
  REQUIRE(v1_header(dataset).size() == 96);
  CHECK(check(file(dataset, {{3, f32}})) == "1");
  CHECK(check(file({{1, space}, {3, shared_at(2, 96), 2}, {8, contiguous}}, {{3, f32}})) == "1");
  // The committed datatype's element size is the one a fill value must have.
  CHECK(check(file({{1, space}, {3, shared_at(3, 120), 2}, {5, msg({2, 2, 2, 1, 2, 0, 0, 0, 0, 0})}, {8, contiguous}},
                   {{3, f32}})) == "d: the object header at 0: a fill value of 2 bytes for elements of 4 bytes");
  // What the committed datatype's header holds is checked as a dataset's own datatype is.
  CHECK(check(file(dataset, {{3, std::vector<std::byte>(f32.begin(), f32.begin() + 8)}})) ==
        "d: the object header at 0: its committed datatype's object header at 96: a datatype message of 8 bytes "
        "(class 1) has parts that run past its end");
  CHECK(check(file(dataset, {{1, space}})) ==
        "d: the object header at 0: its committed datatype's object header at 96: no datatype message");
  CHECK(check(file(dataset, {{3, shared_at(3, 96), 2}})) ==
        "d: the object header at 0: its committed datatype's object header at 96: a datatype shared again");
  CHECK(check(file({{1, space}, {3, shared_at(3, 4096), 2}, {8, contiguous}}, {{3, f32}})) ==
        "d: the object header at 0: its committed datatype's object header at 4096: past the end");
  // In a shared message heap (version 3, type 1), or a shared message cut short.
  for (int version : {2, 3}) {
    auto in_heap = shared_at(version, 0);
    in_heap[1] = std::byte{1};
    CHECK(check(file({{1, space}, {3, in_heap, 2}, {8, contiguous}}, {{3, f32}})) ==
          "d: the object header at 0: its datatype is kept in a shared message heap, which this reader does not read");
  }
  CHECK(check(file({{1, space}, {3, msg({2, 2, 0, 0}), 2}, {8, contiguous}}, {{3, f32}})) ==
        "d: the object header at 0: its datatype: a shared message of 8 bytes (version 2) that is not one");
  // Dataspaces, fill values and filter pipelines are shared only in a shared message heap.
  CHECK(check(file({{1, shared_at(3, 96), 2}, {3, f32}, {8, contiguous}}, {{1, space}})) ==
        "d: the object header at 0: a shared message of type 0x0001, kept where this reader does not read");
  // Classes libhdf5 does not share are decoded whatever the flag says: checked the same.
  CHECK(check(file({{1, space}, {3, f32}, {8, std::vector<std::byte>(contiguous.begin(), contiguous.begin() + 4), 2}},
                   {})).find("layout") != std::string::npos);
}

TEST_CASE("hdf5 layout: an attribute of a committed datatype: the datatype is read where it is, its data by its size") {
  hdf5::Superblock sb;
  // Version 2 attribute "x" (flags: 1 shared datatype, 2 shared dataspace), a scalar dataspace,
  // then `data`; its datatype a shared message (version 3, committed) naming the header at 72.
  const auto attribute = [&](int flags, std::vector<std::byte> data) {
    auto m = msg({2, flags, 2, 0, 10, 0, 8, 0, 'x', 0, 3, 2, 72, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0});
    m.insert(m.end(), data.begin(), data.end());
    return m;
  };
  const auto vlen_string = msg({0x19, 1, 0, 0, 16, 0, 0, 0, 0x10, 0, 0, 0, 1, 0, 0, 0, 0, 0, 8, 0});
  const auto i32 = msg({0x10, 8, 0, 0, 4, 0, 0, 0, 0, 0, 32, 0});
  // length 13, collection 4096, object 1
  const auto vlen_value = msg({13, 0, 0, 0, 0, 0x10, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0});
  const auto find = [&](const std::vector<HeaderMessage>& root, const std::vector<HeaderMessage>& committed) {
    auto b = v1_header(root);
    REQUIRE(b.size() == 72);
    const auto c = v1_header(committed);
    b.insert(b.end(), c.begin(), c.end());
    return hdf5::find_vlen_string_attributes(read_from(b), sb, 0, "f");
  };
  auto found = find({{12, attribute(1, vlen_value)}}, {{3, vlen_string}});
  REQUIRE_MESSAGE(found.ok(), found.status().message());
  REQUIRE(found->size() == 1);
  CHECK((*found)[0].name == "x");
  CHECK((*found)[0].ref.length == 13);
  CHECK((*found)[0].ref.collection == 4096);
  // A committed integer with its 4 bytes: not a string, and not refused for holding too few bytes
  // for one.
  auto attribute_i32 = attribute(1, msg({7, 0, 0, 0}));
  attribute_i32.resize(attribute_i32.size() + 12);  // 28 + 4 bytes, like the vlen one: the header keeps 72 bytes
  found = find({{12, attribute_i32}}, {{3, i32}});
  REQUIRE_MESSAGE(found.ok(), found.status().message());
  CHECK(found->empty());
  // libhdf5 copies the committed type's size x the elements from the message.
  found = find({{12, attribute(1, msg({1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0, 0, 0, 0, 0}))}},
               {{3, msg({0x10, 8, 0, 0, 64, 0, 0, 0, 0, 0, 0, 2})}});
  CHECK(error_of(found.status()) == "f: the object header at 0: attribute 'x': holds 1 elements of 64 bytes in 20 bytes");
  // The committed type is checked as any datatype is.
  found = find({{12, attribute(1, vlen_value)}}, {{3, std::vector<std::byte>(vlen_string.begin(), vlen_string.begin() + 12)}});
  CHECK(error_of(found.status()) == "f: the object header at 0: attribute 'x': its committed datatype's object header "
                                    "at 72: a datatype message of 16 bytes (class 9) has parts that run past its end");
  // A shared dataspace, and a shared attribute message, are kept in a shared message heap.
  found = find({{12, attribute(3, vlen_value)}}, {{3, vlen_string}});
  CHECK(error_of(found.status()) == "f: the object header at 0: an attribute message of 48 bytes has a shared "
                                    "dataspace, kept where this reader does not read");
  found = find({{12, attribute(1, vlen_value), 2}}, {{3, vlen_string}});
  CHECK(error_of(found.status()) == "f: the object header at 0: a shared attribute, kept in a shared message heap, "
                                    "which this reader does not read");
}

TEST_CASE("hdf5: a filter pipeline message naming more filters than it holds is refused before libhdf5 decodes it") {
  // h5py_earliest.h5 with /weight/exp_avg/absmax's filter count (at 18425) 1 -> 17, as
  // fuzz_hdf5_file found it: libhdf5 1.10.8 decoded 16 more filters past the message and took a
  // "name" with strlen past its buffer (H5Dopen2, under ASan).
  const FormatDriver* d = find_format("hdf5");
  if (!d) return;
  testing::TempDir dir;
  const auto bad = write_changed(dir, "h5py_earliest.h5", {{18425, '\x01', '\x11'}});
  auto r = d->open(bad);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().message() == bad.string() + ": dataset '/weight/exp_avg/absmax': the object header at 18320: a "
                                               "filter pipeline message of 32 bytes has filter 1 past its end");
}

TEST_CASE("hdf5 layout: group headers: the links they hold, as written; link messages libhdf5 would read past") {
  // Roots as optstate (1.8 format), h5py and h5py's earliest format (a symbol table: no links in the
  // header) store them.
  for (const auto& [file, want] : std::vector<std::pair<std::string, std::string>>{
           {"adamw8bit_v18.h5", "bias weight "}, {"h5py_edited.h5", "bias weight "}, {"h5py_earliest.h5", ""}}) {
    const std::string& fixture = file;  // CAPTURE's lambda cannot name a structured binding (clang)
    CAPTURE(fixture);
    const auto b = file_bytes(file);
    auto sb = hdf5::parse_superblock(b, file);
    REQUIRE(sb.ok());
    auto links = hdf5::check_group_header(read_from(b), *sb, sb->root_header, file);
    REQUIRE_MESSAGE(links.ok(), links.status().message());
    std::string names;
    for (const auto& l : *links) {
      CHECK(l.type == hdf5::kHardLink);
      CHECK(l.address > 0);
      CHECK(l.address < b.size());
      names += l.name + " ";
    }
    CHECK(names == want);
  }
  {  // h5py_v110_dense.h5: 12 root links, past 8, kept in a fractal heap through a name index
    const auto b = file_bytes("h5py_v110_dense.h5");
    auto sb = hdf5::parse_superblock(b, "f");
    REQUIRE(sb.ok());
    auto links = hdf5::check_group_header(read_from(b), *sb, sb->root_header, "f");
    REQUIRE_MESSAGE(links.ok(), links.status().message());
    std::set<std::string> names;
    for (const auto& l : *links) names.insert(l.name);
    CHECK(names == std::set<std::string>{"bias", "extra0", "extra1", "extra2", "extra3", "extra4", "extra5", "extra6",
                                         "extra7", "extra8", "extra9", "weight"});
  }
  hdf5::Superblock sb;
  const auto msg = [](std::initializer_list<int> v, std::string_view tail = "") {
    std::vector<std::byte> m;
    for (int x : v) m.push_back(static_cast<std::byte>(x));
    for (char c : tail) m.push_back(static_cast<std::byte>(c));
    return m;
  };
  const auto link = [&](const std::vector<std::byte>& m) {
    auto r = hdf5::parse_link_message(m, sb, "m");
    if (!r.ok()) return r.status().message();
    return *r ? fmt::format("{} {} {}", (*r)->name, (*r)->type, (*r)->address) : std::string("refused by libhdf5");
  };
  // A hard link "bias" (a 1-byte name length) to 964, as h5py_edited.h5 holds it.
  CHECK(link(msg({1, 0, 4, 'b', 'i', 'a', 's', 0xc4, 3, 0, 0, 0, 0, 0, 0})) == "bias 0 964");
  CHECK(link(msg({1, 0, 0x40, 'b', 'i', 'a', 's', 0xc4, 3, 0, 0, 0, 0, 0, 0})) ==
        "m: a link message of 15 bytes holds a name of 64 bytes past its end");
  CHECK(link(msg({1, 0, 4, 'b', 'i', 'a', 's', 0xc4, 3})) ==
        "m: a link message of 9 bytes to 'bias' is cut short of its address");
  // flags 0x1c: a type, a creation order (8 bytes) and a character set before the name.
  CHECK(link(msg({1, 0x1c, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 'x', 0xc4, 3, 0, 0, 0, 0, 0, 0})) == "x 0 964");
  // A soft link's value, an external link's (a file name and an object path), by the length stated.
  CHECK(link(msg({1, 0x08, 1, 1, 'x', 2, 0}, "/y")) == "x 1 0");
  CHECK(link(msg({1, 0x08, 1, 1, 'x', 3, 0}, "/y")) == "m: a link message of 9 bytes to 'x' holds a value of 3 "
                                                          "bytes past its end");
  CHECK(link(msg({1, 0x08, 64, 1, 'x', 5, 0, 0, 'f', 0, '/', 'y'})) == "x 64 0");  // flags, "f", "/y"
  CHECK(link(msg({1, 0x08, 64, 1, 'x'})) == "m: a link message of 5 bytes to 'x' is cut short of its value's length");
  CHECK(link(msg({1, 0x03, 0xff, 0xff})) == "m: a link message of 4 bytes is cut short of its name's length");
  CHECK(link(msg({1, 0x08, 7, 1, 'x'})) == "refused by libhdf5");  // a link type libhdf5 does not know
  CHECK(link(msg({2, 0})) == "refused by libhdf5");
  CHECK(link(msg({1, 0, 0})) == "refused by libhdf5");  // an empty name
  // A group header holding a link message cut short is refused as a whole.
  const auto h = v1_header({{6, msg({1, 0, 0x40, 'b', 'i', 'a', 's'})}});
  CHECK(error_of(hdf5::check_group_header(read_from(h), sb, 0, "g").status()) ==
        "g: the object header at 0: a link message of 8 bytes holds a name of 64 bytes past its end");
  CHECK(error_of(hdf5::check_group_header(read_from(v1_header({{0x11, msg({1, 2, 3})}})), sb, 0, "g").status()) ==
        "g: the object header at 0: a symbol table message of 8 bytes is cut short");
}

TEST_CASE("hdf5: a root link message naming more bytes than it holds is refused before libhdf5 looks a name up") {
  // h5py_edited.h5 with the link to /bias's name length (at 186) 4 -> 64: libhdf5 1.10.8 copies
  // names by the length stated.
  const FormatDriver* d = find_format("hdf5");
  if (!d) return;
  testing::TempDir dir;
  const auto bad = write_changed(dir, "h5py_edited.h5", {{186, '\x04', '\x40'}});
  auto r = d->open(bad);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().message() ==
        bad.string() + ": the object header at 48: a link message of 15 bytes holds a name of 64 bytes past its end");
}

TEST_CASE("hdf5: a symbol table's B-tree, symbol nodes and local heap are checked before libhdf5 looks a name up") {
  // h5py_earliest.h5 (h5py's default format: every group a symbol table; K = 4 and 16), the root's
  // table with one byte changed. libhdf5 1.10.8 decodes a symbol node's stated count of entries into
  // an array of 2 x leaf K, follows a local heap's free list block by block, and compares names in
  // the heap as C strings.
  const FormatDriver* d = find_format("hdf5");
  if (!d) return;
  testing::TempDir dir;
  const auto refused = [&](std::initializer_list<std::tuple<size_t, char, char>> change) {
    const auto bad = write_changed(dir, "h5py_earliest.h5", change);
    auto r = d->open(bad);
    REQUIRE_FALSE(r.ok());
    const std::string m = r.status().message();
    REQUIRE(m.rfind(bad.string() + ": the object header at 96: the symbol table's ", 0) == 0);
    return m.substr(bad.string().size() + 46);
  };
  // The root's symbol node (at 6144) holding 2 entries says 64.
  CHECK(refused({{6150, '\x02', '\x40'}}) == "symbol node at 6144 has 64 entries, over the 8 its K allows");
  // The heap's one free block (at 24) names itself as the next one.
  CHECK(refused({{736, '\x01', '\x18'}}) == "local heap at 680 has a free block at 24 twice (a loop)");
  // The B-tree root's last key ("weight" at 16) points past the heap's 88 bytes.
  CHECK(refused({{176, '\x10', '\x60'}}) ==
        "B-tree node at 136: key 1 at heap offset 96 does not end inside the local heap's 88 bytes");
  // Its child is not a symbol node (the child address's low byte 6144 -> 6145).
  CHECK(refused({{168, '\x00', '\x01'}}) == "symbol node at 6145 is not one (\"SNOD\", version 1)");
  // Every group of the file as it is: 2 links at the root, 3 under each param, 2 per 8-bit entry.
  const auto b = file_bytes("h5py_earliest.h5");
  auto sb = hdf5::parse_superblock(b, "f");
  REQUIRE(sb.ok());
  CHECK(sb->group_leaf_k == 4);
  CHECK(sb->group_internal_k == 16);
  for (const auto& [btree, heap, entries] : std::vector<std::tuple<uint64_t, uint64_t, uint64_t>>{
           {136, 680, 2}, {1160, 1704, 3}, {16088, 16632, 3}, {17088, 17632, 2}, {23944, 24488, 2}}) {
    auto n = hdf5::check_symbol_table(read_from(b), *sb, btree, heap, "f");
    REQUIRE_MESSAGE(n.ok(), n.status().message());
    CHECK(*n == entries);
  }
  // A soft link entry (cache type 2) keeps its value's heap offset in the scratch pad: past the heap.
  auto soft = b;
  soft[6144 + 8 + 16] = std::byte{2};   // entry 0's cache type
  soft[6144 + 8 + 24] = std::byte{90};  // its value's offset (u32; a group's B-tree address was there)
  soft[6144 + 8 + 25] = std::byte{0};
  CHECK(error_of(hdf5::check_symbol_table(read_from(soft), *sb, 136, 680, "f").status()) ==
        "f: the symbol table's symbol node at 6144: entry 0's soft link value at heap offset 90 does not end inside "
        "the local heap's 88 bytes");
  // A B-tree level of 1 whose child (the symbol node) is not a level 0 node.
  auto level = b;
  level[136 + 5] = std::byte{1};
  CHECK(error_of(hdf5::check_symbol_table(read_from(level), *sb, 136, 680, "f").status()) ==
        "f: the symbol table's B-tree node at 6144 is not a group node (\"TREE\", type 0)");
}

TEST_CASE("hdf5: a variable-length string attribute of characters wider than a byte is refused before libhdf5 reads it") {
  // h5py_earliest.h5 with the `format` attribute's character size (the base type's, top byte at 863)
  // 1 -> 2^30 + 1, as fuzz_hdf5_file found it: libhdf5 1.10.8 read the 13-character string as 13
  // elements of that size, holding 13 GiB for a while (its memory watchdog named the input).
  const FormatDriver* d = find_format("hdf5");
  if (!d) return;
  testing::TempDir dir;
  const auto bad = write_changed(dir, "h5py_earliest.h5", {{863, '\0', '\x40'}});
  auto r = d->open(bad);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().message() == bad.string() + ": the object header at 96: attribute 'format' is a variable-length "
                                               "string of 1073741825-byte characters (1)");
}

TEST_CASE("hdf5: a variable-length string attribute of elements other than 4 + O + 4 bytes is refused") {
  // h5py_typed_attrs.h5 with the `optstate` attribute's element size (at 1076) 16 -> 5, as
  // fuzz_hdf5_file found it: libhdf5 1.10.8 kept the attribute's data by the stated size (13 bytes
  // where 16 were) and H5Aread copied 16 from it (a heap over-read, under ASan).
  const FormatDriver* d = find_format("hdf5");
  if (!d) return;
  testing::TempDir dir;
  const auto bad = write_changed(dir, "h5py_typed_attrs.h5", {{1076, '\x10', '\x05'}});
  auto r = d->open(bad);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().message() == bad.string() + ": the object header at 96: attribute 'optstate' is a variable-length "
                                               "string of 5-byte elements (16: length, collection address, object "
                                               "index)");
}

TEST_CASE("hdf5 layout: root attributes in dense storage are found through the name index and the fractal heap") {
  // h5py_v110_dense.h5: 13 root attributes, so kept in a fractal heap with a version 2 B-tree
  // name index; `format` and `optstate` are among them.
  const auto b = file_bytes("h5py_v110_dense.h5");
  auto sb = hdf5::parse_superblock(b, "f");
  REQUIRE(sb.ok());
  auto found = hdf5::find_vlen_string_attributes(read_from(b), *sb, sb->root_header, "f");
  REQUIRE_MESSAGE(found.ok(), found.status().message());
  std::set<std::string> names;
  for (const auto& [name, ref] : *found) {
    names.insert(name);
    CHECK(ref.collection > 0);
    CHECK(ref.collection < b.size());
  }
  CHECK(names.count("format") == 1);
  CHECK(names.count("optstate") == 1);
  CHECK(names.count("note9") == 1);
  CHECK(names.size() == 13);  // `optimizer` and the 10 notes too (`ints`, `layout_version`: not strings)
  // A record of the name index naming an object past its direct block: its heap ID (a type byte, 5
  // bytes of offset, 2 of length) given a length of 4095 (the heap's objects are at most 4096).
  const size_t btree = 19697, leaf = 19817;  // the attributes' name index (type 8) and its one leaf
  REQUIRE(std::memcmp(b.data() + btree, "BTHD\0\x08", 6) == 0);
  REQUIRE(std::memcmp(b.data() + leaf, "BTLF\0\x08", 6) == 0);
  auto bad = b;
  bad[leaf + 6 + 6] = std::byte{0xff};
  bad[leaf + 6 + 7] = std::byte{0x0f};
  const std::string err = error_of(hdf5::find_vlen_string_attributes(read_from(bad), *sb, sb->root_header, "f").status());
  CHECK_MESSAGE(err.find("f: the object header at") == 0, err);
  CHECK_MESSAGE(err.find("dense attribute storage: the fractal heap's direct block at") != std::string::npos, err);
}

TEST_CASE("hdf5: a damaged collection of a root attribute kept in dense storage is refused before libhdf5 reads it") {
  // h5py_v110_dense.h5 with the size of object 1 of the collection at 2048 (its top byte at 2078)
  // made 0x52000000000d, as fuzz_hdf5_file found it: `optstate` is kept in dense storage, where the
  // check did not look, and libhdf5 1.10.8's H5HG_read copied that many bytes (under ASan).
  const FormatDriver* d = find_format("hdf5");
  if (!d) return;
  testing::TempDir dir;
  const auto bad = write_changed(dir, "h5py_v110_dense.h5", {{2078, '\0', '\x52'}});
  auto r = d->open(bad);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().message() ==
        bad.string() + ": attribute 'optstate': its global heap collection at 2048: the global heap collection's "
                       "object 1 at offset 16 of 23080948090273805 bytes runs past the collection's 4096 bytes");
}

TEST_CASE("hdf5: a huge heap object is read where the huge object B-tree says, each part checked") {
  // h5py_paged_committed.h5 keeps its root attribute `curve` (6,055 bytes of message) as a huge
  // object of the attributes' fractal heap: its B-tree (type 1, at 4946) has one record at 16902,
  // address(8) 10752, length(8) 6055, key(8) 1.
  const FormatDriver* d = find_format("hdf5");
  if (!d) return;
  testing::TempDir dir;
  const auto refused = [&](std::initializer_list<std::tuple<size_t, char, char>> changes) {
    const auto bad = write_changed(dir, "h5py_paged_committed.h5", changes);
    auto r = d->open(bad);
    REQUIRE_FALSE(r.ok());
    const std::string prefix = bad.string() + ": the object header at ";
    REQUIRE(r.status().message().rfind(prefix, 0) == 0);
    return r.status().message().substr(r.status().message().find("dense attribute storage"));
  };
  // Its length 6055 -> 2^56 + 6055, and -> 4,200,359 (past the file's 18,432 bytes).
  CHECK(refused({{16917, '\0', '\x01'}}) ==
        "dense attribute storage: a huge object of 72057594037933991 bytes (1 to 256 MiB)");
  CHECK(refused({{16912, '\0', '\x40'}}) ==
        "dense attribute storage: the huge object at 10752: 4200359 bytes at address 10752 lie past the file's end");
  // Its key 1 -> 2: the heap ID's key 1 is in no record.
  CHECK(refused({{16918, '\x01', '\x02'}}) ==
        "dense attribute storage: huge object 1 is not in the heap's huge object B-tree");
}

TEST_CASE("hdf5: a link message in dense storage naming more bytes than it holds is refused before a lookup") {
  // h5py_v110_dense.h5 keeps its 12 root links in a fractal heap; the link to /bias (in the direct
  // block at 21773) with its name length (at 21813) 4 -> 127.
  const FormatDriver* d = find_format("hdf5");
  if (!d) return;
  testing::TempDir dir;
  const auto bad = write_changed(dir, "h5py_v110_dense.h5", {{21813, '\x04', '\x7f'}});
  auto r = d->open(bad);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().message() ==
        bad.string() + ": the object header at 48: dense link storage: a link message of 15 bytes holds a name of 127 "
                       "bytes past its end");
}

TEST_CASE("hdf5 layout: superblocks 2-3 take the group K values from their extension, else libhdf5's defaults") {
  for (const char* file : {"adamw8bit_v18.h5", "h5py_edited.h5", "h5py_v110_dense.h5"}) {
    CAPTURE(file);
    const auto b = file_bytes(file);
    auto sb = hdf5::parse_superblock(b, file);
    REQUIRE(sb.ok());
    CHECK(sb->version >= 2);
    CHECK(sb->group_leaf_k == 0);  // not in the superblock itself
    REQUIRE(hdf5::read_superblock_extension(read_from(b), *sb, file).ok());
    CHECK(sb->group_internal_k == 16);
    CHECK(sb->group_leaf_k == 4);
  }
  // An extension (a version 1 object header) with a B-tree 'K' values message of leaf K 8,
  // internal K 32; and one cut short.
  hdf5::Superblock sb;
  sb.version = 2;
  sb.extension = 0;
  const auto k = [](std::initializer_list<int> v) {
    std::vector<std::byte> m;
    for (int x : v) m.push_back(static_cast<std::byte>(x));
    return m;
  };
  REQUIRE(hdf5::read_superblock_extension(read_from(v1_header({{0x13, k({0, 32, 0, 32, 0, 8, 0})}})), sb, "f").ok());
  CHECK(sb.group_internal_k == 32);
  CHECK(sb.group_leaf_k == 8);
  CHECK(error_of(hdf5::read_superblock_extension(read_from(v1_header({{0x13, k({1, 32, 0, 32, 0, 8, 0})}})), sb, "f")) ==
        "f: the superblock extension at 0: a B-tree 'K' values message of 8 bytes is not one (version 0, 7 bytes)");
}

TEST_CASE("hdf5 layout: the superblock extension's messages libhdf5 decodes in H5Fopen are checked before it runs") {
  hdf5::Superblock sb;  // addresses and lengths of 8 bytes
  sb.version = 2;
  sb.extension = 0;
  const auto bytes = [](std::initializer_list<int> v, size_t zeros = 0) {
    std::vector<std::byte> m;
    for (int x : v) m.push_back(static_cast<std::byte>(x));
    m.resize(m.size() + zeros);
    return m;
  };
  const auto extension = [&](int type, const std::vector<std::byte>& body) {
    return error_of(hdf5::read_superblock_extension(read_from(v1_header({{type, body}})), sb, "f"));
  };
  const std::string at = "f: the superblock extension at 0: ";
  // B-tree 'K' values: none of them 0.
  CHECK(extension(0x13, bytes({0, 32, 0, 0, 0, 8, 0})) ==
        at + "a B-tree 'K' values message with a K of 0 (B-tree nodes of no entries)");
  // Driver info: version 0, a name of 8 bytes, then the size of what follows (16, where 8 are:
  // the message is padded to 24 bytes, 11 + 16 > 24).
  CHECK(extension(0x14, bytes({0, 'N', 'C', 'S', 'A', 'm', 'u', 'l', 't', 16, 0}, 8)) ==
        at + "a driver info message of 24 bytes is cut short or not one libhdf5 reads");
  CHECK(extension(0x14, bytes({0, 'N', 'C', 'S', 'A', 'm', 'u', 'l', 't', 13, 0}, 13)) == "ok");
  // File space info version 1: strategy, persist, threshold (8), page size (8), page end
  // threshold (2), EOA before the free-space managers (8), then with persist 12 addresses.
  const auto fsinfo = [&](int strategy, int persist, int page_size_high, size_t addresses) {
    auto m = bytes({1, strategy, persist, 1, 0, 0, 0, 0, 0, 0, 0, 0, page_size_high, 0, 0, 0, 0, 0, 0, 0, 0},
                   8 + 8 * addresses);
    return extension(0x17, m);
  };
  CHECK(fsinfo(1, 0, 0x10, 0) == "ok");  // paged, 4096-byte pages, not persisted
  CHECK(fsinfo(1, 1, 0x10, 12) == "ok");
  CHECK(fsinfo(1, 1, 0x10, 11) == at + "a file space info message of 120 bytes is cut short or not one libhdf5 reads");
  CHECK(fsinfo(4, 0, 0x10, 0) == at + "a file space info message of 32 bytes is cut short or not one libhdf5 reads");
  CHECK(fsinfo(1, 0, 0x00, 0) == at + "a file space page size of 0 bytes (512 B to 1 GiB)");
  // Version 0: strategy 1 ("all persist") is followed by 6 addresses; 0 is no strategy.
  CHECK(extension(0x17, bytes({0, 2}, 8)) == "ok");
  CHECK(extension(0x17, bytes({0, 1}, 8 + 40)) ==
        at + "a file space info message of 56 bytes is cut short or not one libhdf5 reads");
  CHECK(extension(0x17, bytes({0, 0}, 8)) ==
        at + "a file space info message of 16 bytes is cut short or not one libhdf5 reads");
  // A shared message table with indexes, and a metadata cache image, are refused.
  CHECK(extension(0x0F, bytes({0}, 9)) == "ok");
  CHECK(extension(0x0F, bytes({0, 0x40, 0, 0, 0, 0, 0, 0, 0, 3})) ==
        at + "the file keeps shared object header messages (a table of 3 indexes): this reader does not read them");
  CHECK(extension(0x18, bytes({0}, 16)) ==
        at + "the file holds a metadata cache image, which libhdf5 would load in place of the metadata it describes: "
             "this reader does not read one");
}

TEST_CASE("hdf5 layout: superblocks 0-1: the driver information block's stated size lies inside the file") {
  for (const char* file : {"h5py_earliest.h5", "h5py_typed_attrs.h5"}) {
    CAPTURE(file);
    const auto b = file_bytes(file);
    auto sb = hdf5::parse_superblock(b, file);
    REQUIRE(sb.ok());
    CHECK(sb->version < 2);
    CHECK(sb->driver_info == UINT64_MAX);  // h5py writes none
  }
  // version(1)=0, reserved(3), size(4), name(8), then the size's bytes.
  hdf5::Superblock sb;
  sb.version = 0;
  sb.driver_info = 8;
  std::vector<std::byte> b(8 + 16 + 32);
  const auto block = [&](int version, int size) {
    b[8] = static_cast<std::byte>(version);
    b[12] = static_cast<std::byte>(size);
    return error_of(hdf5::check_driver_info_block(read_from(b), sb, "f"));
  };
  CHECK(block(0, 32) == "ok");
  CHECK(block(0, 33) == "f: the driver information block at 8: 33 bytes of driver information run past the file's end");
  CHECK(block(1, 32) == "f: the driver information block at 8: version 1 (0)");
  sb.driver_info = 50;
  CHECK(error_of(hdf5::check_driver_info_block(read_from(b), sb, "f")) ==
        "f: the driver information block at 50: past the end");
}
