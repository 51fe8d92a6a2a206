// Fuzz target for the HDF5 structures the driver parses itself (hdf5_layout.h): a whole file in
// memory, damaged, must give the root's variable-length string attributes' heap references and
// checked collections, and each object header's dataset header check, or an error; never a crash,
// a hang or an unbounded allocation. And a collection the check passes must be one libhdf5's
// loader walks to its end: a model of that loop (each step as H5HG__cache_heap_deserialize takes
// it, bounded) ends exactly at the collection's end and meets the referenced object. libFuzzer
// entry point plus a bounded mutation run of the testdata files (CTest: fuzz.hdf5_layout).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "fuzz_mutate.h"
#include "hdf5_layout.h"

using namespace optstate;
using namespace optstate::hdf5;

namespace {

uint64_t le(const std::vector<std::byte>& b, uint64_t at, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | std::to_integer<uint64_t>(b[at + static_cast<uint64_t>(i)]);
  return v;
}

// libhdf5's loop, step by step: true when it ends at the collection's end having seen `index`.
bool loader_walk_ends(const std::vector<std::byte>& c, int length_size, uint32_t index) {
  const uint64_t size = c.size(), object_header = 8 + static_cast<uint64_t>(length_size);
  uint64_t p = (8 + static_cast<uint64_t>(length_size) + 7) / 8 * 8;
  bool seen = false;
  for (uint64_t steps = 0; p < size; ++steps) {
    if (steps > size) return false;  // more steps than bytes: it would not end
    if (p + object_header > size) {
      p = size;
      break;
    }
    const uint64_t idx = le(c, p, 2), object_size = le(c, p + 8, length_size);
    const uint64_t need = idx > 0 ? object_header + (object_size + 7) / 8 * 8 : object_size;
    if (need == 0 || need > size - p) return false;
    seen |= idx == index;
    p += need;
  }
  return p == size && seen;
}

int parsed = 0;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto file = std::as_bytes(std::span(data, size));
  auto sb = parse_superblock(file.first(std::min<size_t>(size, 256)), "/fuzz");
  if (!sb.ok()) return 0;
  const ReadAt read = [&](uint64_t address, std::span<std::byte> out) -> Status {
    if (address > size || out.size() > size - address) return corrupt("past the end");
    std::memcpy(out.data(), data + address, out.size());
    return Status::Ok();
  };
  if (!read_superblock_extension(read, *sb, "/fuzz").ok()) return 0;  // as the driver: refused
  if (!check_driver_info_block(read, *sb, "/fuzz").ok()) return 0;
  // Every version 2 object header the bytes hold, as the dataset and group header checks before
  // H5Dopen2 and a lookup walk them (the version 1 root too, and the headers its links lead to).
  int headers = 0;
  for (size_t at = 0; at + 4 <= size && headers < 64; ++at)
    if (std::memcmp(data + at, "OHDR", 4) == 0 && ++headers) {
      (void)check_dataset_header(read, *sb, at, "/fuzz");
      (void)check_group_header(read, *sb, at, "/fuzz");
    }
  (void)check_dataset_header(read, *sb, sb->root_header, "/fuzz");
  if (auto links = check_group_header(read, *sb, sb->root_header, "/fuzz"); links.ok())
    for (const Link& link : *links) {
      if (link.name.empty()) std::abort();  // libhdf5 refuses an empty name: so does the parse
      if (link.type == kHardLink) (void)check_group_header(read, *sb, link.address, "/fuzz");
    }
  auto attributes = find_vlen_string_attributes(read, *sb, sb->root_header, "/fuzz");
  if (!attributes.ok()) return 0;
  for (const auto& [name, ref] : *attributes) {
    std::byte head[16];
    if (!read(ref.collection, head).ok()) continue;
    auto n = parse_collection_size(head, sb->length_size, "/fuzz");
    if (!n.ok() || *n > size - ref.collection) continue;  // read() checked ref.collection + 16 <= size
    std::vector<std::byte> c(static_cast<size_t>(*n));
    if (!read(ref.collection, c).ok()) continue;
    if (!check_collection(c, sb->length_size, ref, "/fuzz").ok()) continue;
    ++parsed;
    if (!loader_walk_ends(c, sb->length_size, ref.index)) __builtin_trap();
  }
  return 0;
}

#ifndef OPTSTATE_LIBFUZZER
// fuzz_hdf5_layout <iterations> <seed> <files...>: mutations of each file in turn.
int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: fuzz_hdf5_layout <iterations> <seed> <file>...\n");
    return 2;
  }
  const long iterations = std::atol(argv[1]);
  std::mt19937_64 rng(std::strtoull(argv[2], nullptr, 10));
  std::vector<std::string> seeds;
  for (int i = 3; i < argc; ++i) {
    std::ifstream in(argv[i], std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    if (!in || ss.str().empty()) {
      std::fprintf(stderr, "fuzz_hdf5_layout: cannot read %s\n", argv[i]);
      return 2;
    }
    seeds.push_back(ss.str());
  }
  for (const std::string& s : seeds) LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(s.data()), s.size());
  const int seeds_checked = parsed;
  for (long i = 0; i < iterations; ++i) {
    std::string s = seeds[static_cast<size_t>(i) % seeds.size()];
    optstate::fuzz::mutate(s, rng, "");
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(s.data()), s.size());
  }
  std::printf("fuzz.hdf5_layout: %zu seeds (%d collections checked), %ld inputs (%d collections checked), no crash\n",
              seeds.size(), seeds_checked, iterations, parsed - seeds_checked);
  return 0;
}
#endif
