// Internal to formats/dcp: the writer half of the driver (dcp_writer.cpp).
#pragma once

#include <filesystem>

#include "optstate/checkpoint.h"

namespace optstate::dcp {

Status write_dcp(const OptimizerState& state, const std::filesystem::path& path, const WriteOptions& options);

}  // namespace optstate::dcp
