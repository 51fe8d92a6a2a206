// FSDP2's and FSDP1's per-rank files (verl's) written for another world size: torchsave_ranks.cpp.
#pragma once

#include <filesystem>

#include "optstate/checkpoint.h"
#include "torchsave_reader.h"

namespace optstate::torchsave {

// Writes into `staging` (a fresh directory, published by the caller) every file of `set` (read by
// `reader`) for `world` ranks: the optimizer's and model's files with `source`'s values (the state
// read from `reader`, dense), the other per-rank files from the source rank r % N, the rest copied.
Status write_fsdp_ranks(StateSource& source, const CheckpointReader& reader, const FsdpSet& set,
                         const std::filesystem::path& staging, int world);

}  // namespace optstate::torchsave
