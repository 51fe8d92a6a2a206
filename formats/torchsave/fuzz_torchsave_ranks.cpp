// Fuzz target for the torch.save driver's per-rank sets (verl's layout), built twice: over FSDP2's
// DTensor state (testdata/fsdp2_world2/, fuzz.torchsave_ranks) and over FSDP1's flat parameters
// (testdata/fsdp1_world2/, fuzz.torchsave_fsdp1). The input is rank 1's optimizer file, beside the
// real files of rank 0 and both ranks' model files, so damage reaches the DTensor interpretation, the
// placement of every rank's part (mesh coordinates, boxes, coverage; FSDP1's split of flat
// parameters into the model's params), the names taken from the model files and the cross-rank checks. Each input is also tried with data.pkl's CRC-32 re-signed (as
// fuzz_torchsave_file does). Every input must validate, open, hash, read whole and write back (FSDP2's
// set: as the same folder of one rank's files; FSDP1's: as one file), or give an error; never a crash,
// a hang or an unbounded allocation. Built a third time over FSDP2's set with rank 0's optimizer file
// as the input, written back for 3 ranks (fuzz.torchsave_ranks_write): the pickle the writer emits
// again per rank, its DTensors and device meshes, is the damaged one.
// CTest: fuzz.torchsave_ranks, fuzz.torchsave_fsdp1, fuzz.torchsave_ranks_write (bounded mutation
// runs); with OPTSTATE_LIBFUZZER, coverage-guided.
#include <cstdint>

#include "torchsave/torchsave_fuzz_target.h"

using namespace optstate;

namespace {

const fuzz::CheckpointFixture& fixture() {
#ifdef OPTSTATE_TORCHSAVE_RANKS_WRITE_WORLD
  static const fuzz::CheckpointFixture f("torchsave", OPTSTATE_TORCHSAVE_RANKS_SEED, "optim_world_size_2_rank_0.pt",
                                         "torchsave", OPTSTATE_TORCHSAVE_RANKS_WRITE_WORLD);
#else
  static const fuzz::CheckpointFixture f("torchsave", OPTSTATE_TORCHSAVE_RANKS_SEED, "optim_world_size_2_rank_1.pt");
#endif
  return f;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return torchsave::fuzz_member_input(fixture(), data, size);
}

#ifndef OPTSTATE_LIBFUZZER
int main(int argc, char** argv) {
  return torchsave::fuzz_member_main(fixture(), OPTSTATE_TORCHSAVE_RANKS_TEST, argc, argv);
}
#endif
