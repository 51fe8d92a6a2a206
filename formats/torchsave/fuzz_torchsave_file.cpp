// Fuzz target for the torch.save driver (fuzz_checkpoint.h): the whole file is the input (the zip's
// records, its central directory, data.pkl and the storages), starting from the shared sample state
// as optstate writes it, from files torch, torchao and optstate's Python optimizers wrote, and from
// LibTorch's optimizer archives of torch::optim::AdamW and optstate's AdamW8bit (testdata/). Each
// input is also tried with data.pkl's CRC-32 re-signed, so changes to the pickle reach the
// interpreter rather than stopping at the checksum. Every input must validate, open, hash, read
// whole and write back, or give an error; never a crash, a hang or an unbounded allocation.
// CTest: fuzz.torchsave_file (bounded mutation run); with OPTSTATE_LIBFUZZER, coverage-guided.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "fuzz_checkpoint.h"
#include "torchsave_fuzz_sign.h"

using namespace optstate;

namespace {

const fuzz::CheckpointFixture& fixture() {
  static const fuzz::CheckpointFixture f("torchsave", [](std::string_view file) { return file.size(); });
  return f;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string raw(reinterpret_cast<const char*>(data), size);
  auto signed_input = torchsave::with_pickle_crc(raw);
  fixture().run(signed_input ? *signed_input : raw, fixture().data());
  return 0;
}

#ifndef OPTSTATE_LIBFUZZER
int main(int argc, char** argv) {
  return fixture().main(argc, argv, "fuzz.torchsave_file", "", torchsave::with_pickle_crc);
}
#endif
