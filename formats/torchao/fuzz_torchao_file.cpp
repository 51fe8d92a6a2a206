// Fuzz target for the torchao driver (fuzz_checkpoint.h): the whole torch.save file is the input
// (its records, central directory, data.pkl's state_dict with torchao's OptimState8bit (and
// OptimStateFp8 / OptimState4bit) subclasses and tensor lr, the storages), starting from the shared
// sample state as this driver writes it and from real files of torchao's AdamW8bit, AdamWFp8 and
// AdamW4bit (../torchsave/testdata/). Each input is also tried with data.pkl's CRC-32 re-signed, so
// changes to the pickle reach the interpreter. Every input must validate, open, hash, read whole
// and write back in torchao's layout with the same values, or give an error; never a crash, a hang
// or an unbounded allocation.
// CTest: fuzz.torchao_file (bounded mutation run); with OPTSTATE_LIBFUZZER, coverage-guided.
#include <cstddef>
#include <cstdint>

#include "torchsave/torchsave_fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return optstate::torchsave::fuzz_zip_input("torchao", data, size);
}

#ifndef OPTSTATE_LIBFUZZER
int main(int argc, char** argv) {
  return optstate::torchsave::fuzz_zip_main("torchao", "fuzz.torchao_file", argc, argv);
}
#endif
