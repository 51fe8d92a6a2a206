// The format drivers compiled into this build (each folder under formats/ adds itself) and
// auto-detection over them.
#pragma once

#include <filesystem>
#include <memory>
#include <span>
#include <string_view>

#include "optstate/checkpoint.h"

namespace optstate {

std::span<const FormatDriver* const> format_drivers();
const FormatDriver* find_format(std::string_view name);
// The driver whose sniffer recognizes `path`, or an error naming the path.
Result<const FormatDriver*> detect_format(const std::filesystem::path& path);
// detect_format + open.
Result<std::unique_ptr<CheckpointReader>> open_checkpoint(const std::filesystem::path& path);

}  // namespace optstate
