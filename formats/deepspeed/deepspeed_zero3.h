// The deepspeed driver's ZeRO-3 writer (deepspeed_zero3.cpp).
#pragma once

#include <filesystem>

#include "optstate/checkpoint.h"

namespace optstate::deepspeed {

// Writes into `staging` the ZeRO-3 checkpoint of `source` (the state read from the ZeRO-3
// checkpoint at `source_path`) for `world` data-parallel ranks: zero_pp_rank_R_mp_rank_00_optim_states.pt
// and zero_pp_rank_R_mp_rank_00_model_states.pt for R < world, as DeepSpeed saves them.
Status write_zero3(StateSource& source, const std::filesystem::path& source_path, const std::filesystem::path& staging,
                   int world);

}  // namespace optstate::deepspeed
