// Fuzz target for the deepspeed driver, built three times: over a ZeRO-2 checkpoint
// (testdata/zero2_world2/, fuzz.deepspeed_zero2) and a ZeRO-3 one (testdata/zero3_world2/,
// fuzz.deepspeed_zero3), both real (make_seeds.py). The input is rank 1's optimizer file, beside the
// real files of rank 0 and the model states, so damage reaches the ZeRO interpretation (stage,
// partition counts, the wrapped optimizer's groups and flat state, param_slice_mappings), the
// placement of every param's runs across the ranks' partitions and the cross-rank checks. Each input
// is also tried with data.pkl's CRC-32 re-signed (as fuzz_torchsave_file does). Every input must
// validate, open, hash, read whole and write back (as a native checkpoint: DeepSpeed's format is
// written only from a ZeRO checkpoint), or give an error; never a crash, a hang or an unbounded
// allocation.
// Built a third time over DeepSpeed's universal checkpoint of the ZeRO-3 one
// (testdata/zero3_world2_universal/, ds_to_universal's; fuzz.deepspeed_universal): the input is
// zero/optimizer_state.pt (settings, param groups, the nested state with each group's step).
// Built a fourth time over the sub-grouped ZeRO-3 checkpoint (testdata/zero3_subgroups_world2/),
// written back by DeepSpeed's own ZeRO-3 writer for 3 ranks (fuzz.deepspeed_zero3_write): the input
// is rank 0's optimizer file, whose pickle the writer emits again with its partitions replaced.
// Built twice over a pipeline's checkpoint (testdata/pipe2_zero1_world4/: 2 stages of 2 ranks): the
// input is stage 1's rank 0 optimizer file (fuzz.deepspeed_pipe: its runs of the tied module's copy,
// which validate compares with stage 0's) or stage 1's model states file (fuzz.deepspeed_pipe_model:
// its params, groups and grid).
// Built over AutoTP's tensor-parallel checkpoint (testdata/autotp2_zero1_world2/: 2 ranks): the input
// is rank 0's model states file (fuzz.deepspeed_autotp: the affine maps that place every rank's
// shards, the replicated blocks validate compares).
// Built over DeepSpeed MoE's checkpoint (testdata/moe_zero1_world4/: 4 experts over ep_size 2 on 4
// ranks): the input is rank 1's optimizer file (fuzz.deepspeed_moe: the groups' partition counts and
// expert-parallel sizes, the placement of each expert-parallel rank's experts under global numbers).
// And over AutoEP's (testdata/autoep_zero1_world4/): the input is the model states file
// (fuzz.deepspeed_autoep: ds_autoep_layers, the experts' affine maps, param_shapes).
// And over bf16 without ZeRO (testdata/bf16_zero0_world2/): the input is the model states file, the
// optimizer inside it (fuzz.deepspeed_zero0: FP16_UnfusedOptimizer's dict, the fp32 masters by group,
// the params named after ['module'] by order and shape). And over fp16 without ZeRO around DeepSpeed's
// FusedAdam (testdata/fp16_fused_zero0_world2/): the input is the model states file
// (fuzz.deepspeed_zero0_fused: FP16_Optimizer's flat masters and moments, the params placed in them
// where the masters round to ['module']'s weights). And over a pipeline under bf16 without ZeRO
// (testdata/bf16_pipe2_zero0_world4/): the input is layer 3's weights file (fuzz.deepspeed_pipe_bf16_layer:
// BF16_Optimizer's model states name no shape; the layer files' tensors give them). And over MoE
// without ZeRO (testdata/moe_zero0_world4/): the input is expert-parallel rank 1's optimizer file
// (fuzz.deepspeed_moe_zero0: its groups matched to rank 0's, its numbered params placed among its
// experts' files' tensors), and over its FP16_Optimizer form (testdata/moe_bf16_fused_zero0_world4/:
// fuzz.deepspeed_moe_fused_zero0, rank 1's flat groups, its params found in them by value).
// CTest: fuzz.deepspeed_zero2, fuzz.deepspeed_zero3, fuzz.deepspeed_universal,
// fuzz.deepspeed_zero3_write, fuzz.deepspeed_bnb_zero2, fuzz.deepspeed_pipe, fuzz.deepspeed_pipe_model,
// fuzz.deepspeed_autotp, fuzz.deepspeed_moe, fuzz.deepspeed_autoep, fuzz.deepspeed_zero0,
// fuzz.deepspeed_zero0_fused, fuzz.deepspeed_pipe_bf16_layer, fuzz.deepspeed_moe_zero0,
// fuzz.deepspeed_moe_fused_zero0 (bounded mutation runs); with OPTSTATE_LIBFUZZER, coverage-guided.
#include <cstdint>

#include "torchsave/torchsave_fuzz_target.h"

using namespace optstate;

namespace {

const fuzz::CheckpointFixture& fixture() {
#ifdef OPTSTATE_DEEPSPEED_WRITE_WORLD
  static const fuzz::CheckpointFixture f("deepspeed", OPTSTATE_DEEPSPEED_SEED, OPTSTATE_DEEPSPEED_MEMBER, "deepspeed",
                                         OPTSTATE_DEEPSPEED_WRITE_WORLD);
#else
  static const fuzz::CheckpointFixture f("deepspeed", OPTSTATE_DEEPSPEED_SEED, OPTSTATE_DEEPSPEED_MEMBER);
#endif
  return f;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return torchsave::fuzz_member_input(fixture(), data, size);
}

#ifndef OPTSTATE_LIBFUZZER
int main(int argc, char** argv) {
  return torchsave::fuzz_member_main(fixture(), OPTSTATE_DEEPSPEED_TEST, argc, argv);
}
#endif
