// Fuzz target for the LibTorch driver (fuzz_checkpoint.h): the whole archive is the input (its
// records, central directory, data.pkl's module tree and the storages), starting from the shared
// sample state as this driver writes it and from the archives LibTorch itself wrote for
// torch::optim::AdamW and optstate's AdamW8bit (testdata/). Each input is also tried with data.pkl's
// CRC-32 re-signed, so changes to the pickle reach the interpreter. Every input must validate,
// open, hash, read whole and write back as an archive with the same values, or give an error; never
// a crash, a hang or an unbounded allocation.
// CTest: fuzz.libtorch_archive (bounded mutation run); with OPTSTATE_LIBFUZZER, coverage-guided.
#include <cstddef>
#include <cstdint>

#include "torchsave/torchsave_fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return optstate::torchsave::fuzz_zip_input("libtorch", data, size);
}

#ifndef OPTSTATE_LIBFUZZER
int main(int argc, char** argv) {
  return optstate::torchsave::fuzz_zip_main("libtorch", "fuzz.libtorch_archive", argc, argv);
}
#endif
