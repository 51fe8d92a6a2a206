// Fuzz target for a whole DCP checkpoint (fuzz_checkpoint.h): the .metadata's promises against the
// data files of a real 2-rank checkpoint written by optstate (storage offsets and lengths, item
// paths, chunk shapes, the zip and torch.save payload of each item, 8-bit pairs, a model's buffers
// beside the state: model.<name> items streamed as its other tensors). Inputs are
// .metadata pickles; the bounded run (CTest: fuzz.dcp_checkpoint) also damages data files.
// `--print-seed` prints the seed .metadata (testdata/checkpoint/.metadata).
// Built a second time with OPTSTATE_DCP_QUANTIZED (fuzz.dcp_torchao_checkpoint): the checkpoint
// written as `convert --to 8bit --format dcp` writes it (each rank's rows of the 8-bit moments a
// torchao OptimState8bit item, lr a tensor), written back DCP -> DCP keeping torchao's items; seed
// testdata/checkpoint_torchao/.metadata.
// Built a third time with OPTSTATE_DCP_NUMBERED_SEED (fuzz.dcp_numbered_checkpoint): over torch's own
// DCP of an optimizer.state_dict() saved as it is (testdata/numbered/, make_numbered.py), the state
// keyed by param number and named after the model's tensors beside it (name_numbered: the metadata's
// order, the placement of each group's params), written back numbered.
// Built a fourth time with OPTSTATE_DCP_ZSTD_SEED (fuzz.dcp_zstd_checkpoint): over torch's DCP
// saved through its ZStandard extension (testdata/zstd/, make_zstd.py), the input replacing the data
// file, so the zstd streams themselves (libzstd's decoder behind the output cap, then the archives
// they decode to); written back DCP -> DCP, carrying the run's values still compressed.
// Built a fifth time with OPTSTATE_DCP_HF_STORAGE_SEED (fuzz.dcp_hf_storage_checkpoint): over NeMo
// Automodel's step folder of the writers corpus (optim/ a DCP, model/ DCP's Hugging Face storage:
// hf_storage.h), the input replacing rank 0's safetensors file of weights (its header, its
// DCP_SHARDING_INFO, its pieces); written back as one DCP.
// Built a sixth time with OPTSTATE_DCP_SAFETENSORS_SEED (fuzz.dcp_safetensors_checkpoint): over
// torch's DCP saved with serialization_format=SAFETENSORS (testdata/safetensors/,
// make_safetensors.py), the input replacing the data file: its bytes items, then the safetensors
// blob its tensor chunks are read from (hf_storage::resolve_safetensors_blobs).
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "fuzz_checkpoint.h"

using namespace optstate;

namespace {

const fuzz::CheckpointFixture& fixture() {
#if defined(OPTSTATE_DCP_HF_STORAGE_SEED)
  static const fuzz::CheckpointFixture f("dcp", OPTSTATE_DCP_HF_STORAGE_SEED,
                                         "model/shard-00001-model-00001-of-00001.safetensors");
#elif defined(OPTSTATE_DCP_SAFETENSORS_SEED)
  static const fuzz::CheckpointFixture f("dcp", OPTSTATE_DCP_SAFETENSORS_SEED, "__0_0.distcp");
#elif defined(OPTSTATE_DCP_ZSTD_SEED)
  static const fuzz::CheckpointFixture f("dcp", OPTSTATE_DCP_ZSTD_SEED, "__0_0.distcp");
#elif defined(OPTSTATE_DCP_NUMBERED_SEED)
  static const fuzz::CheckpointFixture f("dcp", OPTSTATE_DCP_NUMBERED_SEED, ".metadata");
#elif defined(OPTSTATE_DCP_QUANTIZED)
  static const fuzz::CheckpointFixture f("dcp", 2, ".metadata", /*quantized=*/true);
#else
  static const fuzz::CheckpointFixture f("dcp", 2, ".metadata", /*quantized=*/false, /*model_tensors=*/true);
#endif
  return f;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fixture().run(std::string_view(reinterpret_cast<const char*>(data), size), fixture().data());
  return 0;
}

#ifndef OPTSTATE_LIBFUZZER
int main(int argc, char** argv) {
#if defined(OPTSTATE_DCP_HF_STORAGE_SEED)
  const char* test = "fuzz.dcp_hf_storage_checkpoint";
#elif defined(OPTSTATE_DCP_SAFETENSORS_SEED)
  const char* test = "fuzz.dcp_safetensors_checkpoint";
#elif defined(OPTSTATE_DCP_ZSTD_SEED)
  const char* test = "fuzz.dcp_zstd_checkpoint";
#elif defined(OPTSTATE_DCP_NUMBERED_SEED)
  const char* test = "fuzz.dcp_numbered_checkpoint";
#elif defined(OPTSTATE_DCP_QUANTIZED)
  const char* test = "fuzz.dcp_torchao_checkpoint";
#else
  const char* test = "fuzz.dcp_checkpoint";
#endif
  return fixture().main(argc, argv, test, "",
                        [](const std::string&) { return std::optional<std::string>(); });
}
#endif
