// Fuzz target for the torch.save driver (fuzz_checkpoint.h): the whole file is the input (the zip's
// records, its central directory, data.pkl and the storages), starting from the shared sample state
// as optstate writes it and from files torch, torchao and optstate's Python optimizers wrote
// (testdata/). Every input must validate, open, hash, read whole and write back, or give an error;
// never a crash, a hang or an unbounded allocation. CTest: fuzz.torchsave_file (bounded mutation
// run); with OPTSTATE_LIBFUZZER, coverage-guided from testdata/.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "fuzz_checkpoint.h"

using namespace optstate;

namespace {

const fuzz::CheckpointFixture& fixture() {
  static const fuzz::CheckpointFixture f("torchsave", [](std::string_view file) { return file.size(); });
  return f;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fixture().run(std::string_view(reinterpret_cast<const char*>(data), size), fixture().data());
  return 0;
}

#ifndef OPTSTATE_LIBFUZZER
int main(int argc, char** argv) {
  return fixture().main(argc, argv, "fuzz.torchsave_file", "", [](const std::string&) { return std::nullopt; });
}
#endif
