// Fuzz target for nanotron checkpoints (nanotron_layout.h, torchsave::open_rank_files), over real ones
// nanotron saved (tests/data/writers/nanotron-2411b02_torch-2.13.0/, make_nanotron.py). Built three
// times: the input is the ZeRO-1 one's optimizer_config.json (the runs and shapes that place each
// rank's flat runs: fuzz.nanotron_config), or its data-parallel rank 1's optimizer file (torch.save;
// each input also tried with data.pkl's CRC-32 re-signed, so changes reach the interpretation:
// fuzz.nanotron_file), or the tensor-parallel one's shard of a fused q/k/v projection under model/
// (safetensors: its TensorMetadata places the shard: fuzz.nanotron_shard). Every input must
// validate, open, hash, read whole and write back (native), or give an error.
#include <cstdint>
#include <optional>
#include <string>

#include "fuzz_checkpoint.h"
#include "torchsave/torchsave_fuzz_sign.h"

using namespace optstate;

namespace {

const fuzz::CheckpointFixture& fixture() {
  static const fuzz::CheckpointFixture f("nanotron", OPTSTATE_NANOTRON_SEED, OPTSTATE_NANOTRON_MEMBER);
  return f;
}

std::optional<std::string> signed_input(const std::string& raw) {
  if (!std::string(OPTSTATE_NANOTRON_MEMBER).ends_with(".pt")) return std::nullopt;
  return torchsave::with_pickle_crc(raw);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string raw(reinterpret_cast<const char*>(data), size);
  const auto re_signed = signed_input(raw);
  fixture().run(re_signed ? *re_signed : raw, fixture().data());
  return 0;
}

#ifndef OPTSTATE_LIBFUZZER
int main(int argc, char** argv) { return fixture().main(argc, argv, OPTSTATE_NANOTRON_TEST, "", signed_input); }
#endif
