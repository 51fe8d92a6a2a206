#include "test_helpers.h"

#include <fstream>
#include <iterator>
#include <random>
#include <unistd.h>

namespace optstate::testing {

TempDir::TempDir() {
  std::random_device rd;
  path = std::filesystem::temp_directory_path() / ("optstate-test-" + std::to_string(::getpid()) + "-" +
                                                   std::to_string(rd()));
  std::filesystem::create_directories(path);
}
TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}
void write_file(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

Buffer f32_buffer(const std::vector<float>& values) {
  return Buffer::copy_of(std::as_bytes(std::span(values)));
}

OptimizerState sample_state() {
  OptimizerState s;
  s.kind = "adamw";
  ParamGroup g0, g1;
  g0.hyper.weight_decay = 0.1;
  g1.hyper.weight_decay = 0.0;
  g0.params = {"layers.0.weight"};
  g1.params = {"layers.0.bias"};
  s.groups = {g0, g1};

  ParamState w;
  w.shape = {2, 3};
  w.step = 5;
  w.group = 0;
  Entry m, v, p;
  m.values = f32_buffer({0.1f, -0.2f, 0.3f, -0.4f, 0.5f, -0.6f});
  v.values = f32_buffer({0.01f, 0.04f, 0.09f, 0.16f, 0.25f, 0.36f});
  p.dtype = DType::kBF16;
  const std::vector<uint16_t> bf = {0x3f80, 0x4000, 0x4040, 0xbf80, 0x0000, 0x3f00};
  p.values = Buffer::copy_of(std::as_bytes(std::span(bf)));
  w.param_dtype = DType::kBF16;
  w.entries = {{kExpAvg, m}, {kExpAvgSq, v}, {kParam, p}};

  ParamState b;
  b.shape = {3};
  b.step = 5;
  b.group = 1;
  Entry bm, bv;
  bm.values = f32_buffer({1.0f, 2.0f, 3.0f});
  bv.values = f32_buffer({1.0f, 4.0f, 9.0f});
  b.entries = {{kExpAvg, bm}, {kExpAvgSq, bv}};
  s.params = {{"layers.0.weight", w}, {"layers.0.bias", b}};
  return s;
}

}  // namespace optstate::testing
