// Fuzz target for a whole DCP checkpoint of torchao's AdamW8bit items (fuzz_checkpoint.h): a 2-rank
// checkpoint written by optstate as `convert --to 8bit --format dcp` writes it (each rank's rows of
// the 8-bit moment an OptimState8bit item, lr a tensor), its .metadata mutated; reading it, and
// writing it back DCP -> DCP (which keeps torchao's items) must give a result or an error.
// `--print-seed` prints the seed .metadata (testdata/checkpoint_torchao/.metadata).
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "fuzz_checkpoint.h"

using namespace optstate;

namespace {

const fuzz::CheckpointFixture& fixture() {
  static const fuzz::CheckpointFixture f("dcp", 2, ".metadata", /*quantized=*/true);
  return f;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fixture().run(std::string_view(reinterpret_cast<const char*>(data), size), fixture().data());
  return 0;
}

#ifndef OPTSTATE_LIBFUZZER
int main(int argc, char** argv) {
  return fixture().main(argc, argv, "fuzz.dcp_torchao_checkpoint", "",
                        [](const std::string&) { return std::optional<std::string>(); });
}
#endif
