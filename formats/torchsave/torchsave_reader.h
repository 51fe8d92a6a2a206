// The torch.save driver's reader of one file, for formats whose files are torch.save's zip with a
// pickle it interprets: LibTorch's optimizer archives (formats/libtorch/) open through it.
#pragma once

#include <filesystem>
#include <memory>

#include "optstate/checkpoint.h"

namespace optstate::torchsave {

Result<std::unique_ptr<CheckpointReader>> open_file(const std::filesystem::path& path);

}  // namespace optstate::torchsave
