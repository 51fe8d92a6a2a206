// What every fuzz target over one torch.save zip file shares (the torch.save, LibTorch,
// bitsandbytes and torchao drivers' targets): the fixture of the driver (fuzz_checkpoint.h: the whole file is
// the input, starting from the shared sample state as the driver writes it and the seeds), and each
// input tried with data.pkl's CRC-32 re-signed too, so changes to the pickle reach the interpreter.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "fuzz_checkpoint.h"
#include "torchsave/torchsave_fuzz_sign.h"

namespace optstate::torchsave {

// One fixture per target binary: the first driver asked for.
inline const fuzz::CheckpointFixture& zip_fixture(std::string_view driver) {
  static const fuzz::CheckpointFixture f(driver, [](std::string_view file) { return file.size(); });
  return f;
}

inline int fuzz_zip_input(std::string_view driver, const uint8_t* data, size_t size) {
  const std::string raw(reinterpret_cast<const char*>(data), size);
  auto signed_input = with_pickle_crc(raw);
  zip_fixture(driver).run(signed_input ? *signed_input : raw, zip_fixture(driver).data());
  return 0;
}

// The target's main() without libFuzzer (the bounded mutation run CTest starts).
inline int fuzz_zip_main(std::string_view driver, const char* test, int argc, char** argv) {
  return zip_fixture(driver).main(argc, argv, test, "", with_pickle_crc);
}

// Targets over a folder of real torch.save files, one of which is the input (FSDP's per-rank sets,
// DeepSpeed's ZeRO checkpoints): the fixture `f` holds the rest; re-signed as above.
inline int fuzz_member_input(const fuzz::CheckpointFixture& f, const uint8_t* data, size_t size) {
  const std::string raw(reinterpret_cast<const char*>(data), size);
  auto signed_input = with_pickle_crc(raw);
  f.run(signed_input ? *signed_input : raw, f.data());
  return 0;
}

inline int fuzz_member_main(const fuzz::CheckpointFixture& f, const char* test, int argc, char** argv) {
  return f.main(argc, argv, test, "", with_pickle_crc);
}

}  // namespace optstate::torchsave
