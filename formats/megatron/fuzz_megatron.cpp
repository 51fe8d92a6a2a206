// Fuzz target for Megatron-LM's legacy checkpoints (megatron_layout.h, torchsave::open_nanotron in
// Megatron's kind), over real ones Megatron-Core's optimizer saved
// (tests/data/writers/megatron-core-0.16.1_torch-2.13.0/legacy_*, make_megatron.py). Built twice:
// the input is tensor-parallel rank 1's model_optim_rng.pt of the tensor-parallel one (its args,
// its model dict's names that place the params and split them, the main params:
// fuzz.megatron_rank), or the distributed optimizer's distrib_optim.pt (its buffers, whose values
// place the params: fuzz.megatron_distrib); torch.save files, each input also tried with data.pkl's
// CRC-32 re-signed, so changes reach the interpretation. Every input must validate, open, hash,
// read whole and write back (native), or give an error.
#include <cstdint>
#include <optional>
#include <string>

#include "fuzz_checkpoint.h"
#include "torchsave/torchsave_fuzz_sign.h"

using namespace optstate;

namespace {

const fuzz::CheckpointFixture& fixture() {
  static const fuzz::CheckpointFixture f("megatron", OPTSTATE_MEGATRON_SEED, OPTSTATE_MEGATRON_MEMBER);
  return f;
}

std::optional<std::string> signed_input(const std::string& raw) { return torchsave::with_pickle_crc(raw); }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string raw(reinterpret_cast<const char*>(data), size);
  const auto re_signed = signed_input(raw);
  fixture().run(re_signed ? *re_signed : raw, fixture().data());
  return 0;
}

#ifndef OPTSTATE_LIBFUZZER
int main(int argc, char** argv) { return fixture().main(argc, argv, OPTSTATE_MEGATRON_TEST, "", signed_input); }
#endif
