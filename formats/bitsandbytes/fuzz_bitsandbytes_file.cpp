// Fuzz target for the bitsandbytes driver (fuzz_checkpoint.h): the whole torch.save file is the
// input (its records, central directory, data.pkl's state_dict with bitsandbytes' state1/state2,
// absmax and qmap tensors, the storages), starting from the shared sample state as this driver
// writes it and from real files of bitsandbytes' AdamW8bit (its 0.50 layout and the older one,
// ../torchsave/testdata/). Each input is also tried with data.pkl's CRC-32 re-signed, so changes to
// the pickle reach the interpreter. Every input must validate, open, hash, read whole and write
// back in bitsandbytes' layout with the same values, or give an error; never a crash, a hang or an
// unbounded allocation.
// CTest: fuzz.bitsandbytes_file (bounded mutation run); with OPTSTATE_LIBFUZZER, coverage-guided.
#include <cstddef>
#include <cstdint>

#include "torchsave/torchsave_fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return optstate::torchsave::fuzz_zip_input("bitsandbytes", data, size);
}

#ifndef OPTSTATE_LIBFUZZER
int main(int argc, char** argv) {
  return optstate::torchsave::fuzz_zip_main("bitsandbytes", "fuzz.bitsandbytes_file", argc, argv);
}
#endif
