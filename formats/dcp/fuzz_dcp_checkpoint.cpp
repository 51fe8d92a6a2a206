// Fuzz target for a whole DCP checkpoint (fuzz_checkpoint.h): the .metadata's promises against the
// data files of a real 2-rank checkpoint written by optstate (storage offsets and lengths, item
// paths, chunk shapes, the zip and torch.save payload of each item, 8-bit pairs). Inputs are
// .metadata pickles; the bounded run (CTest: fuzz.dcp_checkpoint) also damages data files.
// `--print-seed` prints the seed .metadata (testdata/checkpoint/.metadata).
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "fuzz_checkpoint.h"

using namespace optstate;

namespace {

const fuzz::CheckpointFixture& fixture() {
  static const fuzz::CheckpointFixture f("dcp", 2, ".metadata");
  return f;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fixture().run(std::string_view(reinterpret_cast<const char*>(data), size), fixture().data());
  return 0;
}

#ifndef OPTSTATE_LIBFUZZER
int main(int argc, char** argv) {
  return fixture().main(argc, argv, "fuzz.dcp_checkpoint", "",
                        [](const std::string&) { return std::optional<std::string>(); });
}
#endif
