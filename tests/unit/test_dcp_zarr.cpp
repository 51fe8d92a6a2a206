// Megatron-Core's zarr backend (formats/dcp/zarr.h): `.zarray` documents as Megatron writes them,
// and those refused; the chunk grid, its file names and which edge chunks read as a prefix.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "dcp/zarr.h"

using namespace optstate;
namespace zr = optstate::dcp::zarr;

namespace {

// A `.zarray` as zarr 2.18 writes Megatron's (json.dumps with indent 4, sorted keys), its fields
// replaced where `fields` says so.
std::string zarray(const std::string& shape, const std::string& chunks, const std::string& dtype = "\"<f4\"",
                   const std::string& more = "") {
  return "{\n    \"chunks\": " + chunks + ",\n    \"compressor\": null,\n    \"dtype\": " + dtype +
         ",\n    \"fill_value\": null,\n    \"filters\": null,\n    \"order\": \"C\",\n    \"shape\": " + shape +
         ",\n    \"zarr_format\": 2" + more + "\n}";
}

std::string message_of(const Result<zr::Array>& r) { return r.ok() ? "" : std::string(r.status().message()); }

}  // namespace

TEST_CASE("zarr: .zarray as Megatron-Core writes it (f32, bf16 under tensorstore's numpy dtype, 0-d)") {
  auto a = zr::parse_zarray(zarray("[2, 32, 8]", "[1, 16, 8]"), "w");
  REQUIRE(a.ok());
  CHECK(a->shape == std::vector<int64_t>{2, 32, 8});
  CHECK(a->chunks == std::vector<int64_t>{1, 16, 8});
  CHECK(a->dtype == DType::kF32);
  CHECK(a->separator == '.');
  CHECK(zr::chunk_count(*a) == 4);
  CHECK(zr::chunk_bytes(*a) == 16 * 8 * 4);
  auto b = zr::parse_zarray(zarray("[16, 8]", "[8, 8]", "\"bfloat16\""), "w");
  REQUIRE(b.ok());
  CHECK(b->dtype == DType::kBF16);
  auto s = zr::parse_zarray(zarray("[]", "[]", "\"<i8\""), "w");
  REQUIRE(s.ok());
  CHECK(zr::chunk_count(*s) == 1);
  CHECK(zr::chunk_file_name(zr::chunk_grid(*s)[0].index, '.') == "0");
  auto nested = zr::parse_zarray(zarray("[4]", "[2]", "\"|u1\"", ",\n    \"dimension_separator\": \"/\""), "w");
  REQUIRE(nested.ok());
  CHECK(nested->separator == '/');
  CHECK(nested->dtype == DType::kU8);
}

TEST_CASE("zarr: the grid in C order, its file names, edge chunks clipped") {
  auto a = zr::parse_zarray(zarray("[5, 4]", "[2, 4]"), "w");
  REQUIRE(a.ok());
  const auto grid = zr::chunk_grid(*a);
  REQUIRE(grid.size() == 3);
  CHECK(zr::chunk_file_name(grid[1].index, '.') == "1.0");
  CHECK(grid[2].box.offsets == std::vector<int64_t>{4, 0});
  CHECK(grid[2].box.sizes == std::vector<int64_t>{1, 4});  // clipped on the first axis: a prefix
  CHECK(zr::box_is_prefix(grid[2].box.sizes, a->chunks));
  auto b = zr::parse_zarray(zarray("[2, 3, 5]", "[1, 2, 2]"), "w");
  REQUIRE(b.ok());
  const auto g2 = zr::chunk_grid(*b);
  CHECK(g2.size() == 2 * 2 * 3);
  CHECK(zr::chunk_file_name(g2.back().index, '/') == "1/1/2");
  CHECK(g2.back().box.sizes == std::vector<int64_t>{1, 1, 1});
  CHECK(zr::box_is_prefix({1, 1, 1}, b->chunks));       // leading axes one wide, then clipped: a prefix
  CHECK(zr::box_is_prefix({1, 2, 1}, b->chunks) == false);  // clipped on an inner axis after a full one
  CHECK(zr::box_is_prefix({1, 1, 2}, b->chunks));
  auto empty = zr::parse_zarray(zarray("[0, 4]", "[1, 4]"), "w");
  REQUIRE(empty.ok());
  CHECK(zr::chunk_grid(*empty).empty());
}

TEST_CASE("zarr: arrays optstate does not read are refused, naming why") {
  CHECK(message_of(zr::parse_zarray(zarray("[4]", "[2]", "\"<f4\"", ",\n    \"zarr_format\": 3"), "w"))
            .find("twice") != std::string::npos);
  std::string v3 = zarray("[4]", "[2]");
  v3.replace(v3.find("\"zarr_format\": 2"), 16, "\"zarr_format\": 3");
  CHECK(message_of(zr::parse_zarray(v3, "w")).find("zarr_format 2") != std::string::npos);
  std::string blosc = zarray("[4]", "[2]");
  blosc.replace(blosc.find("\"compressor\": null"), 18, R"("compressor": {"id": "blosc", "clevel": 5})");
  CHECK(message_of(zr::parse_zarray(blosc, "w")).find("compressed with {\"clevel\":5,\"id\":\"blosc\"}") != std::string::npos);
  std::string fortran = zarray("[4]", "[2]");
  fortran.replace(fortran.find("\"order\": \"C\""), 12, "\"order\": \"F\"");
  CHECK(message_of(zr::parse_zarray(fortran, "w")).find("Fortran order") != std::string::npos);
  CHECK(message_of(zr::parse_zarray(zarray("[4]", "[2]", "\">f4\""), "w")).find("dtype '>f4' is not read") !=
        std::string::npos);
  CHECK(message_of(zr::parse_zarray(zarray("[4]", "[2]", "\"<V2\""), "w")).find("dtype '<V2'") != std::string::npos);
  CHECK(message_of(zr::parse_zarray(zarray("[4]", "[2]", R"([["a", "<f4"]])"), "w")).find("structured") !=
        std::string::npos);
  CHECK(message_of(zr::parse_zarray(zarray("[4, 2]", "[2]"), "w")).find("different axes") != std::string::npos);
  CHECK(message_of(zr::parse_zarray(zarray("[4]", "[0]"), "w")).find("under 1") != std::string::npos);
  CHECK(message_of(zr::parse_zarray(zarray("[-4]", "[2]"), "w")).find("shape [-4]") != std::string::npos);
  CHECK(message_of(zr::parse_zarray(zarray("[4.5]", "[2]"), "w")).find("non-integer") != std::string::npos);
  CHECK(message_of(zr::parse_zarray(zarray("[1048577, 2]", "[1, 1]"), "w")).find("more than 1048576 chunks") !=
        std::string::npos);
  CHECK(message_of(zr::parse_zarray(zarray("[1099511627776]", "[1099511627776]"), "w")).find("a chunk over") !=
        std::string::npos);
  CHECK(message_of(zr::parse_zarray("[1, 2]", "w")).find("not a JSON object") != std::string::npos);
  CHECK(message_of(zr::parse_zarray(zarray("[4]", "[2]").substr(0, 40), "w")).find("not a JSON object") !=
        std::string::npos);
}
