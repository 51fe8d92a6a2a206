// DCP's Hugging Face storage (formats/dcp/hf_storage.h): safetensors headers as NeMo Automodel's
// storage writer leaves them (each rank's pieces placed by DCP_SHARDING_INFO), as items and raw
// chunks, and what is refused.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <string>
#include <vector>

#include "dcp/hf_storage.h"

using namespace optstate;
namespace hf = optstate::dcp::hf_storage;
using optstate::safetensors::Header;
using optstate::safetensors::TensorInfo;

namespace {

// A header of one rank's file: tensors laid out one after another from byte 0 of the data.
Header shard(const std::vector<std::pair<std::string, std::vector<int64_t>>>& tensors, const std::string& info,
             DType dtype = DType::kF32) {
  Header h;
  h.data_start = 128;
  uint64_t at = 0;
  for (const auto& [name, shape] : tensors) {
    uint64_t n = 1;
    for (int64_t d : shape) n *= static_cast<uint64_t>(d);
    const uint64_t bytes = n * dtype_size(dtype);
    h.tensors[name] = TensorInfo{dtype, shape, at, at + bytes};
    at += bytes;
  }
  if (!info.empty()) h.metadata[hf::kShardingInfoKey] = info;
  return h;
}

std::string message_of(const Status& s) { return s.ok() ? "" : std::string(s.message()); }

}  // namespace

TEST_CASE("hf_storage: two ranks' pieces of a row-sharded weight and a bias make whole items") {
  dcp::Metadata md;
  const std::string rank0 = R"({"w": {"saved_offsets": [0, 0]}, "b": {"saved_offsets": [0]}})";
  const std::string rank1 = R"({"w": {"saved_offsets": [17, 0]}, "b": {"saved_offsets": [17]}})";
  REQUIRE(hf::add_file(shard({{"w", {17, 16}}, {"b", {17}}}, rank0), "shard-00001.safetensors", md, "f1").ok());
  REQUIRE(hf::add_file(shard({{"w", {16, 16}}, {"b", {16}}}, rank1), "shard-00002.safetensors", md, "f2").ok());
  hf::finish(md);
  REQUIRE(md.items.size() == 2);
  const dcp::ItemMeta& w = md.items.at("w");
  CHECK(w.is_tensor);
  CHECK(w.dtype == DType::kF32);
  CHECK(w.size == std::vector<int64_t>{33, 16});
  REQUIRE(w.chunks.size() == 2);
  CHECK(w.chunks[1].offsets == std::vector<int64_t>{17, 0});
  CHECK(w.chunks[1].sizes == std::vector<int64_t>{16, 16});
  CHECK(md.items.at("b").size == std::vector<int64_t>{33});
  // each piece stored raw at the file's data start + its begin
  const dcp::StorageLoc& second = md.storage.at(dcp::ChunkKey{"w", {17, 0}});
  CHECK(second.relative_path == "shard-00002.safetensors");
  CHECK(second.offset == 128);
  CHECK(second.length == 16 * 16 * 4);
  CHECK(second.raw_shape == std::vector<int64_t>{16, 16});
  const dcp::StorageLoc& bias = md.storage.at(dcp::ChunkKey{"b", {0}});
  CHECK(bias.offset == 128 + 17 * 16 * 4);
}

TEST_CASE("hf_storage: a file without sharding info holds whole tensors (torch's reader takes it so)") {
  dcp::Metadata md;
  REQUIRE(hf::add_file(shard({{"w", {4, 2}}}, "", DType::kBF16), "model.safetensors", md, "f").ok());
  hf::finish(md);
  CHECK(md.items.at("w").size == std::vector<int64_t>{4, 2});
  CHECK(md.items.at("w").dtype == DType::kBF16);
  CHECK(md.storage.count(dcp::ChunkKey{"w", {0, 0}}) == 1);
}

TEST_CASE("hf_storage: what the sharding info may say wrongly is refused, naming the file and tensor") {
  auto refused = [](const std::vector<Header>& files) {
    dcp::Metadata md;
    for (size_t i = 0; i < files.size(); ++i) {
      const Status s = hf::add_file(files[i], fmt::format("f{}", i), md, fmt::format("file{}", i));
      if (!s.ok()) return message_of(s);
    }
    return std::string();
  };
  CHECK(refused({shard({{"w", {2, 2}}}, "{not json")}).find("file0: DCP_SHARDING_INFO") != std::string::npos);
  CHECK(refused({shard({{"w", {2, 2}}}, "[1, 2]")}).find("not a JSON object") != std::string::npos);
  CHECK(refused({shard({{"w", {2, 2}}}, R"({"w": {"saved_offsets": [0, 0]}, "w": {"saved_offsets": [0, 0]}})")})
            .find("names 'w' twice") != std::string::npos);
  CHECK(refused({shard({{"w", {2, 2}}, {"b", {2}}}, R"({"w": {"saved_offsets": [0, 0]}})")}) ==
        "file0: tensor 'b': not placed by DCP_SHARDING_INFO");
  CHECK(refused({shard({{"w", {2, 2}}}, R"({"w": {"saved_offsets": [0]}})")}) ==
        "file0: tensor 'w': 1 saved_offsets for a piece of 2 axes");
  CHECK(refused({shard({{"w", {2, 2}}}, R"({"w": {"saved_offsets": [0, -1]}})")}).find("not a whole number >= 0") !=
        std::string::npos);
  CHECK(refused({shard({{"w", {2, 2}}}, R"({"w": {"saved_offsets": [0, 1.5]}})")}).find("not a whole number >= 0") !=
        std::string::npos);
  CHECK(refused({shard({{"w", {2, 2}}}, R"({"w": {"offsets": [0, 0]}})")}).find("no saved_offsets list") !=
        std::string::npos);
  CHECK(refused({shard({{"w", {2, 2}}}, R"({"w": {"saved_offsets": [0, 1125899906842625]}})")})
            .find("ends past 2^50") != std::string::npos);
  // two files' pieces at the same place, or of different dtypes or axes
  CHECK(refused({shard({{"w", {2, 2}}}, R"({"w": {"saved_offsets": [0, 0]}})"),
                 shard({{"w", {2, 2}}}, R"({"w": {"saved_offsets": [0, 0]}})")}) ==
        "file1: tensor 'w': a second piece at offsets [0, 0]");
  CHECK(refused({shard({{"w", {2, 2}}}, R"({"w": {"saved_offsets": [0, 0]}})"),
                 shard({{"w", {2, 2}}}, R"({"w": {"saved_offsets": [2, 0]}})", DType::kBF16)})
            .find("file1: tensor 'w': a piece of bf16 [2, 2] where another file's is f32 of 2 axes") != std::string::npos);
  CHECK(refused({shard({{"w", {2, 2}}}, R"({"w": {"saved_offsets": [0, 0]}})"),
                 shard({{"w", {2}}}, R"({"w": {"saved_offsets": [2]}})")})
            .find("where another file's is f32 of 2 axes") != std::string::npos);
}
