// Fuzz target for the torch.save driver (fuzz_checkpoint.h): the whole file is the input (the zip's
// records, its central directory, data.pkl and the storages), starting from the shared sample state
// as optstate writes it, from files torch, torchao and optstate's Python optimizers wrote, and from
// LibTorch's optimizer archives of torch::optim::AdamW and optstate's AdamW8bit (testdata/). Each
// input is also tried with data.pkl's CRC-32 re-signed, so changes to the pickle reach the
// interpreter rather than stopping at the checksum. Every input must validate, open, hash, read
// whole and write back, or give an error; never a crash, a hang or an unbounded allocation.
// CTest: fuzz.torchsave_file (bounded mutation run); with OPTSTATE_LIBFUZZER, coverage-guided.
#include <cstddef>
#include <cstdint>

#include "torchsave_fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return optstate::torchsave::fuzz_zip_input("torchsave", data, size);
}

#ifndef OPTSTATE_LIBFUZZER
int main(int argc, char** argv) {
  return optstate::torchsave::fuzz_zip_main("torchsave", "fuzz.torchsave_file", argc, argv);
}
#endif
