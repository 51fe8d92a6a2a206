// Fuzz target for the HDF5 driver (fuzz_checkpoint.h): a damaged optstate HDF5 file, written from
// the shared sample state (dense and 8-bit entries), must validate, open, hash, read whole and write
// back, or give an error; never a crash or a hang. The bytes go through libhdf5 itself (its parsing is
// its own; this exercises our checks around it: metadata, dataset types and shapes, ranges, codes and
// scales). The whole file is the input: HDF5 keeps its metadata and raw data interleaved. Bounded
// mutation run of the real file (CTest: fuzz.hdf5_file); libhdf5 is not instrumented, so there is no
// libFuzzer build of this target.
#include <string>
#include <string_view>

#include "fuzz_checkpoint.h"

using namespace optstate;

int main(int argc, char** argv) {
  if (!find_format("hdf5")) return 0;
  const fuzz::CheckpointFixture f("hdf5", [](std::string_view file) { return file.size(); });
  return f.main(argc, argv, "fuzz.hdf5_file", "", [](const std::string&) { return std::nullopt; });
}
