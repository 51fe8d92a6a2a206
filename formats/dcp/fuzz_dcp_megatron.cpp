// Fuzz target for Megatron-Core's torch_dist checkpoints (megatron.h), over real ones Megatron saved
// (tests/data/writers/, make_megatron.py). Built five times: the input is the common.pt of 0.16's
// under tensor parallelism 2 (the param groups without members, the step, the trainer's other state;
// each input also tried with data.pkl's CRC-32 re-signed, so changes reach the interpretation:
// fuzz.dcp_megatron_common; a data file is run as it is and with every entry of every record
// re-signed), or its .metadata (the sharded keys, stacked chunks and storage records
// against the real data files: fuzz.dcp_megatron_metadata), or the .metadata of 0.13's distributed
// optimizer (N-D flattened items: mcore_data's shapes, chunk boxes and element ranges split between
// ranks: fuzz.dcp_megatron_nd_metadata), or the .metadata or first data file of 0.16's distributed
// optimizer saved dp_reshardable (bucket items, their chunks and values, placed on the weights by
// value: fuzz.dcp_megatron_dp_metadata, fuzz.dcp_megatron_dp_data), or, of 0.9's zarr backend
// (zarr.h), an array's .zarray against its chunk files (fuzz.dcp_megatron_zarr_zarray), one of those
// chunk files (fuzz.dcp_megatron_zarr_chunk), or the common.pt of NeMo 1.x's checkpoint dict
// (optimizer_states, re-signed: fuzz.dcp_megatron_nemo1_common), or the distributed optimizer's
// gathered state saved dp_zero_gather_scatter (its buffers' dict and flat tensors, re-signed, walked
// by value against the weights beside: fuzz.dcp_megatron_dp_zero_state), or the first data file of
// 0.19's under tensor parallelism 2, whose common_state item holds the common state
// (fuzz.dcp_megatron_mcore019_data), or the integrity.json of 0.19's saved with verify_integrity
// (names and SHA-256 digests of the folder's files: fuzz.dcp_megatron_mcore019_integrity), or the
// .metadata of Megatron-FSDP's fsdp_dtensor checkpoint (per-param groups, each rank's uneven chunks,
// names under the wrappers' module.: fuzz.dcp_megatron_fsdp_dtensor_metadata).
// Every input must validate, open, hash, read whole and write back (a plain DCP), or give an error.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "fuzz_checkpoint.h"
#include "torchsave/torchsave_fuzz_sign.h"

using namespace optstate;

namespace {

const fuzz::CheckpointFixture& fixture() {
  static const fuzz::CheckpointFixture f("dcp", OPTSTATE_MEGATRON_SEED, OPTSTATE_MEGATRON_MEMBER);
  return f;
}

std::optional<std::string> signed_input(const std::string& raw) {
  const std::string_view member = OPTSTATE_MEGATRON_MEMBER;
  if (member.ends_with(".pt")) return torchsave::with_pickle_crc(raw);        // a torch.save file
  if (member.ends_with(".distcp")) return torchsave::with_record_crcs(raw);   // a data file of records
  return std::nullopt;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string raw(reinterpret_cast<const char*>(data), size);
  const auto re_signed = signed_input(raw);
  // A data file as it is too: its CRC-32 checks are code to reach as well (a torch.save member's
  // re-signed form alone, as before).
  if (!re_signed || *re_signed == raw || std::string_view(OPTSTATE_MEGATRON_MEMBER).ends_with(".distcp"))
    fixture().run(raw, fixture().data());
  if (re_signed && *re_signed != raw) fixture().run(*re_signed, fixture().data());
  return 0;
}

#ifndef OPTSTATE_LIBFUZZER
int main(int argc, char** argv) { return fixture().main(argc, argv, OPTSTATE_MEGATRON_TEST, "", signed_input); }
#endif
