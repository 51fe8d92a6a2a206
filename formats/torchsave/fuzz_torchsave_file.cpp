// Fuzz target for the torch.save driver (fuzz_checkpoint.h): the whole file is the input (the zip's
// records, its central directory, data.pkl and the storages), starting from the shared sample state
// as optstate writes it and from files torch, torchao and optstate's Python optimizers wrote
// (testdata/). Each input is also tried with data.pkl's CRC-32 re-signed, so changes to the pickle
// reach the interpreter rather than stopping at the checksum. Every input must validate, open, hash,
// read whole and write back, or give an error; never a crash, a hang or an unbounded allocation.
// CTest: fuzz.torchsave_file (bounded mutation run); with OPTSTATE_LIBFUZZER, coverage-guided.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "dcp/zip.h"
#include "fuzz_checkpoint.h"

using namespace optstate;

namespace {

const fuzz::CheckpointFixture& fixture() {
  static const fuzz::CheckpointFixture f("torchsave", [](std::string_view file) { return file.size(); });
  return f;
}

void put_u32(std::string& s, uint64_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) s[at + i] = static_cast<char>(v >> (8 * i) & 0xff);
}

uint32_t get_u16(const std::string& s, uint64_t at) {
  return static_cast<uint8_t>(s[at]) | static_cast<uint32_t>(static_cast<uint8_t>(s[at + 1])) << 8;
}

// The input with data.pkl's CRC-32 set to that of its bytes, in its local header and its directory
// entry; nothing where the zip does not parse that far.
std::optional<std::string> with_pickle_crc(const std::string& in) {
  const auto bytes = std::as_bytes(std::span(in));
  const uint64_t n = in.size();
  auto cd = zip::find_central_directory(bytes.subspan(n - std::min<uint64_t>(n, zip::kMaxTailBytes)), n, "fuzz");
  if (!cd.ok() || cd->offset > n || cd->size > n - cd->offset) return std::nullopt;
  auto entries = zip::parse_central_directory(bytes.subspan(cd->offset, cd->size), *cd, "fuzz");
  if (!entries.ok()) return std::nullopt;
  for (const zip::Entry& e : *entries) {
    if (!e.name.ends_with("/data.pkl") || e.local_header_offset > n || n - e.local_header_offset < 30) continue;
    auto at = zip::data_offset(bytes.subspan(e.local_header_offset, 30), e, cd->offset, "fuzz");
    if (!at.ok()) return std::nullopt;
    const uint32_t crc = zip::crc32(bytes.subspan(*at, e.size));
    std::string out = in;
    put_u32(out, e.local_header_offset + 14, crc);
    // Its directory entry: walk the records (46 fixed bytes, name, extra, comment) to the one named so.
    for (uint64_t p = cd->offset; p + 46 <= cd->offset + cd->size;) {
      const uint64_t name_len = get_u16(in, p + 28), next = p + 46 + name_len + get_u16(in, p + 30) + get_u16(in, p + 32);
      if (next > n) break;
      if (std::string_view(in).substr(p + 46, name_len) == e.name) put_u32(out, p + 16, crc);
      p = next;
    }
    return out;
  }
  return std::nullopt;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string raw(reinterpret_cast<const char*>(data), size);
  auto signed_input = with_pickle_crc(raw);
  fixture().run(signed_input ? *signed_input : raw, fixture().data());
  return 0;
}

#ifndef OPTSTATE_LIBFUZZER
int main(int argc, char** argv) {
  return fixture().main(argc, argv, "fuzz.torchsave_file", "", with_pickle_crc);
}
#endif
