// The canonical state's metadata (kind, groups, hyperparameters, params with shapes, dtypes, steps
// and entry encodings; no values) as one JSON text, for formats whose own container has no place
// for it: safetensors' __metadata__, HDF5 attributes. Parsing treats the text as hostile.
#pragma once

#include <string>
#include <string_view>

#include "optstate/state.h"

namespace optstate {

inline constexpr int kStateJsonVersion = 1;

std::string encode_state_meta(const OptimizerState& state);
// `where` names the file in errors. The result has empty buffers and passes check_structure.
Result<OptimizerState> decode_state_meta(std::string_view text, const std::string& where);

// JSON holds finite numbers only (nlohmann writes NaN and the infinities as null, which no reader
// takes for a number): a state with a hyperparameter that is not (a diverged schedule's NaN lr)
// has no place in optstate's JSON metadata. The native, safetensors and HDF5 writers refuse it,
// naming the group, before they write anything.
Status check_json_numbers(const OptimizerState& state);

}  // namespace optstate
