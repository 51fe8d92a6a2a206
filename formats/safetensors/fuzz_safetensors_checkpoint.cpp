// Fuzz target for a whole safetensors checkpoint (fuzz_checkpoint.h): the header's promises against
// the data after it, in a real file with dense and 8-bit entries (tensor offsets and sizes against
// the data buffer, the optstate metadata against the tensors, codes and scales). Inputs are headers,
// their 8-byte length prefix set to what follows it, so the JSON is reached whatever its length;
// the bounded run (CTest: fuzz.safetensors_checkpoint) also damages the data. `--print-seed` prints
// the seed header (testdata/checkpoint/header).
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "fuzz_checkpoint.h"

using namespace optstate;

namespace {

uint64_t length_prefix(std::string_view s) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | static_cast<uint8_t>(s[static_cast<size_t>(i)]);
  return n;
}

// The header's size in a safetensors file: its length prefix and the JSON.
size_t header_size(std::string_view file) { return file.size() < 8 ? 0 : 8 + length_prefix(file); }

// The input with its length prefix (little-endian u64) set to the size of what follows it.
std::optional<std::string> with_length(const std::string& input) {
  if (input.size() < 8) return std::nullopt;
  std::string out = input;
  uint64_t n = input.size() - 8;
  for (size_t i = 0; i < 8; ++i, n >>= 8) out[i] = static_cast<char>(n & 0xff);
  return out;
}

const fuzz::CheckpointFixture& fixture() {
  static const fuzz::CheckpointFixture f("safetensors", header_size);
  return f;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string raw(reinterpret_cast<const char*>(data), size);
  auto fixed = with_length(raw);
  fixture().run(fixed ? *fixed : raw, fixture().data());
  return 0;
}

#ifndef OPTSTATE_LIBFUZZER
int main(int argc, char** argv) {
  return fixture().main(argc, argv, "fuzz.safetensors_checkpoint", fuzz::kJsonAlphabet, with_length);
}
#endif
