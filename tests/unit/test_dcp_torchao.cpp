// The DCP driver against real torchao checkpoints of FSDP2 (formats/dcp/testdata/): items whose
// chunks torchao quantized on some ranks only.
#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "optstate/checkpoint.h"
#include "optstate/validate.h"
#include "registry.h"
#include "test_helpers.h"

using namespace optstate;

TEST_CASE("dcp: a torchao item 8-bit on one rank and plain on the other reads as torchao's dequantized values") {
  // formats/dcp/testdata/make_fsdp2_torchao.py: FSDP2 on two ranks; 0.weight (257x32) is 129 rows
  // on rank 0 (4128 elements: not whole blocks, kept plain by torchao) and 128 rows on rank 1
  // (quantized); the reference values are torchao's own dequantize() of each rank's part.
  const std::filesystem::path data = std::filesystem::path(OPTSTATE_SOURCE_DIR) / "formats/dcp/testdata";
  auto r = open_checkpoint(data / "fsdp2_torchao");
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  // torchao's state, though no moment is 8-bit on every rank (rank 0's chunks, read first, are plain).
  CHECK((*r)->meta().kind == "adamw8bit");
  const Entry& e = (*r)->meta().params.at("0.weight").entries.at(kExpAvg);
  CHECK(e.encoding == Encoding::kDense);
  CHECK(e.dtype == DType::kF32);
  const std::vector<std::pair<std::string, std::string>> entries = {
      {"0.weight", kExpAvg}, {"0.weight", kExpAvgSq}, {"1.weight", kExpAvg}, {"1.weight", kExpAvgSq}};
  for (const auto& fe : entries) {
    const std::string& fqn = fe.first;  // not a structured binding: clang 14 cannot capture those
    const std::string& entry = fe.second;
    CAPTURE(fqn);
    CAPTURE(entry);
    const std::string want = testing::read_file(data / "fsdp2_torchao_values" / (fqn + "." + entry + ".f32"));
    std::string got;
    REQUIRE((*r)->stream(fqn, entry, Component::kValues, [&](std::span<const std::byte> b) {
                   got.append(reinterpret_cast<const char*>(b.data()), b.size());
                   return Status::Ok();
                 }).ok());
    CHECK(got.size() == want.size());
    CHECK(got == want);
    // A range across the plain rows and the 8-bit ones (rows 128..130 of 0.weight).
    if (fqn == "0.weight") {
      std::vector<float> part(32 * 2);
      REQUIRE((*r)->read_range(fqn, entry, Component::kValues, 32 * 128, 32 * 130, std::as_writable_bytes(std::span(part))).ok());
      CHECK(std::memcmp(part.data(), want.data() + 4 * 32 * 128, part.size() * 4) == 0);
    }
  }
  // Every chunk's CRC-32 (codes and scales of the 8-bit one too) checks out in a validate.
  auto report = validate_checkpoint(data / "fsdp2_torchao", [](const std::filesystem::path& p) { return open_checkpoint(p); });
  REQUIRE(report.ok());
  CHECK(report->ok());
}
