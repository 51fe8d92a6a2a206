// Fuzz target for Megatron-LM's legacy checkpoints (megatron_layout.h, torchsave::open_rank_files in
// Megatron's kind), over real ones Megatron-Core's optimizer saved
// (tests/data/writers/megatron-core-0.16.1_torch-2.13.0/legacy_*, make_megatron.py). Built five
// times: the input is tensor-parallel rank 1's model_optim_rng.pt of the tensor-parallel one (its
// args, its model dict's names that place the params and split them, the main params:
// fuzz.megatron_rank), the distributed optimizer's distrib_optim.pt (its buffers, whose values
// place the params: fuzz.megatron_distrib), or a mixture of experts' expert rank 1's
// model_optim_rng.pt (Megatron's chain of optimizers, its local experts: fuzz.megatron_expert_rank)
// or distrib_optim.pt (the chain's states: fuzz.megatron_expert_distrib), or a virtual pipeline's
// stage 1 model_optim_rng.pt (model0, model1: fuzz.megatron_chunk_rank); torch.save files, each
// input also tried with data.pkl's CRC-32 re-signed, so changes reach the interpretation. Every
// input must validate, open, hash, read whole and write back (native), or give an error.
#include <cstdint>

#include "torchsave/torchsave_fuzz_target.h"

using namespace optstate;

namespace {

const fuzz::CheckpointFixture& fixture() {
  static const fuzz::CheckpointFixture f("megatron", OPTSTATE_MEGATRON_SEED, OPTSTATE_MEGATRON_MEMBER);
  return f;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return torchsave::fuzz_member_input(fixture(), data, size);
}

#ifndef OPTSTATE_LIBFUZZER
int main(int argc, char** argv) { return torchsave::fuzz_member_main(fixture(), OPTSTATE_MEGATRON_TEST, argc, argv); }
#endif
