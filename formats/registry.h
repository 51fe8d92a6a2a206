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
// What a writer may put its output in place of at `path`: nothing; or, with `overwrite`, a
// checkpoint in any format this build opens, or an empty directory. Anything else (a directory of
// other files, a file that is no checkpoint) is refused naming it: overwriting replaces checkpoints
// and never deletes what optstate did not write. Every driver's write checks this first.
Status check_destination(const std::filesystem::path& path, bool overwrite);
// detect_format + open.
Result<std::unique_ptr<CheckpointReader>> open_checkpoint(const std::filesystem::path& path);

}  // namespace optstate
