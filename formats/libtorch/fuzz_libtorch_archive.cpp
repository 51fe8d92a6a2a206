// Fuzz target for the LibTorch driver (fuzz_checkpoint.h): the whole archive is the input (its
// records, central directory, data.pkl's module tree and the storages), starting from the shared
// sample state as this driver writes it and from the archives LibTorch itself wrote for
// torch::optim::AdamW and optstate's AdamW8bit (testdata/). Each input is also tried with data.pkl's
// CRC-32 re-signed, so changes to the pickle reach the interpreter. Every input must validate,
// open, hash, read whole and write back as an archive with the same values, or give an error; never
// a crash, a hang or an unbounded allocation.
// CTest: fuzz.libtorch_archive (bounded mutation run); with OPTSTATE_LIBFUZZER, coverage-guided.
#include <cstdint>
#include <string>
#include <string_view>

#include "fuzz_checkpoint.h"
#include "torchsave/torchsave_fuzz_sign.h"

using namespace optstate;

namespace {

const fuzz::CheckpointFixture& fixture() {
  static const fuzz::CheckpointFixture f("libtorch", [](std::string_view file) { return file.size(); });
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
  return fixture().main(argc, argv, "fuzz.libtorch_archive", "", torchsave::with_pickle_crc);
}
#endif
