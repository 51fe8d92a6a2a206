// Fuzz target for a whole native checkpoint (fuzz_checkpoint.h): the manifest's promises against
// the data files of a real 2-rank checkpoint with dense and 8-bit entries (sizes, chunk offsets,
// checksums, codes and scales, ranks). Inputs are manifests, re-signed so the checks behind the
// manifest checksum are reached; the bounded run (CTest: fuzz.native_checkpoint) also damages data
// files. `--print-seed` prints the seed manifest (testdata/checkpoint/manifest.json).
#include <cstdint>
#include <string>
#include <string_view>

#include "fuzz_checkpoint.h"
#include "native_manifest.h"

using namespace optstate;

namespace {

const fuzz::CheckpointFixture& fixture() {
  static const fuzz::CheckpointFixture f("native", 2, native::kManifestName);
  return f;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string raw(reinterpret_cast<const char*>(data), size);
  auto signed_input = native::resign_manifest_for_tests(raw);
  fixture().run(signed_input ? *signed_input : raw, fixture().data());
  return 0;
}

#ifndef OPTSTATE_LIBFUZZER
int main(int argc, char** argv) {
  return fixture().main(argc, argv, "fuzz.native_checkpoint", fuzz::kJsonAlphabet, native::resign_manifest_for_tests);
}
#endif
