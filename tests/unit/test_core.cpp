#include <doctest/doctest.h>

#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include "optstate/dtype.h"
#include "optstate/io.h"
#include "optstate/state.h"
#include "optstate/status.h"
#include "test_helpers.h"

using namespace optstate;

TEST_CASE("Result carries a value or a failed status") {
  Result<int> ok = 3;
  CHECK(ok.ok());
  CHECK(*ok == 3);
  Result<int> bad = corrupt("x.bin: bad");
  CHECK(!bad.ok());
  CHECK(bad.status().code() == ErrorCode::kCorrupt);
  CHECK(bad.status().to_string() == "corrupt: x.bin: bad");
  Result<int> from_ok = Status::Ok();  // misuse is turned into an internal error, never an ok Result
  CHECK(!from_ok.ok());
  CHECK(from_ok.status().code() == ErrorCode::kInternal);
  CHECK(io_error("a").with_context("ctx").message() == "ctx: a");
}

TEST_CASE("dtype table round-trips every name") {
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16, DType::kF64, DType::kU8, DType::kI8, DType::kI32,
                  DType::kI64, DType::kI16, DType::kBool, DType::kC64, DType::kC128, DType::kF8E4M3FN,
                  DType::kF8E5M2, DType::kF8E4M3FNUZ, DType::kF8E5M2FNUZ, DType::kF8E8M0FNU, DType::kU16,
                  DType::kU32, DType::kU64, DType::kF4E2M1FNX2}) {
    const auto& info = dtype_info(d);
    CHECK(info.dtype == d);
    CHECK(dtype_from_name(info.name) == d);
    if (!info.safetensors_name.empty()) CHECK(dtype_from_safetensors(info.safetensors_name) == d);
    CHECK(dtype_from_torch_name(std::string("torch.") + std::string(info.torch_name)) == d);
    if (!info.torch_storage.empty()) CHECK(dtype_from_torch_storage(info.torch_storage) == d);
  }
  // float8 and uint16..64 have no legacy storage class: torch pickles them as UntypedStorage.
  CHECK(dtype_info(DType::kF8E4M3FN).torch_storage.empty());
  CHECK(!dtype_from_torch_storage("UntypedStorage").has_value());
  CHECK(!dtype_info(DType::kF8E4M3FN).is_float);  // a frozen weight's dtype, never the state's
  CHECK(dtype_from_safetensors("F8_E4M3") == DType::kF8E4M3FN);
  CHECK(dtype_size(DType::kU64) == 8);
  // Only the float dtypes are the state's; complex128 has no safetensors name, and an empty one
  // names nothing.
  CHECK(!dtype_info(DType::kC64).is_float);
  CHECK(dtype_size(DType::kC64) == 8);
  CHECK(dtype_size(DType::kC128) == 16);
  CHECK(!dtype_from_safetensors("").has_value());
  CHECK(!dtype_from_name("f8").has_value());
}

TEST_CASE("bf16 and f16 conversions are exact and round to nearest even") {
  CHECK(bf16_to_f32(0x3f80) == 1.0f);
  CHECK(f32_to_bf16(1.0f) == 0x3f80);
  // 1 + 2^-8 is exactly halfway between two bf16 values: ties go to the even one (1.0).
  CHECK(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)) == 0x3f80);
  CHECK(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)) == 0x3f82);
  CHECK(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()) == 0x7fc0);
  CHECK(f16_to_f32(0x3c00) == 1.0f);
  CHECK(f16_to_f32(0x0001) == std::ldexp(1.0f, -24));
  CHECK(f16_to_f32(0xfc00) == -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(f16_to_f32(0x7e00)));
}

TEST_CASE("checked_numel refuses hostile shapes") {
  CHECK(*checked_numel({}) == 1);
  CHECK(*checked_numel({2, 0, 5}) == 0);
  CHECK(!checked_numel({-1}).ok());
  CHECK(!checked_numel({int64_t{1} << 40, int64_t{1} << 40}).ok());
  CHECK(!checked_numel(std::vector<int64_t>(17, 1)).ok());
}

TEST_CASE("check_structure finds inconsistent states") {
  OptimizerState s = testing::sample_state();
  CHECK(check_structure(s, true).ok());
  SUBCASE("buffer of the wrong size") {
    s.params["layers.0.bias"].entries[kExpAvg].values = testing::f32_buffer({1.0f});
    Status st = check_structure(s, true);
    CHECK(!st.ok());
    CHECK(st.message().find("layers.0.bias.exp_avg") != std::string::npos);
  }
  SUBCASE("group out of range") {
    s.params["layers.0.bias"].group = 7;
    CHECK(!check_structure(s, false).ok());
  }
  SUBCASE("unknown optimizer kind") {
    s.kind = "sgd";
    CHECK(check_structure(s, false).code() == ErrorCode::kUnsupported);
  }
  SUBCASE("group lists a param that does not exist") {
    s.groups[0].params.push_back("ghost");
    CHECK(!check_structure(s, false).ok());
  }
  SUBCASE("a param name that is not UTF-8 (a lone surrogate, as Python pickles one)") {
    const std::string bad = "w\xed\xb3\xbf.weight";
    auto node = s.params.extract("layers.0.bias");
    node.key() = bad;
    s.params.insert(std::move(node));
    for (auto& g : s.groups)
      for (auto& name : g.params)
        if (name == "layers.0.bias") name = bad;
    const Status st = check_names(s);
    CHECK(st.code() == ErrorCode::kCorrupt);
    CHECK(st.message() == "param name 'w\\xed\\xb3\\xbf.weight' is not valid UTF-8 (byte 1); names must be text");
    CHECK(check_structure(s, false).code() == ErrorCode::kCorrupt);
  }
  SUBCASE("a param name with a line break (hash prints one name per line)") {
    s.groups.clear();
    s.params.clear();
    s.groups.emplace_back();
    const std::string forged = "w\n0123456789abcdef0123456789abcdef  (root)";
    s.params[forged].group = 0;
    s.groups[0].params.push_back(forged);
    const Status st = check_names(s);
    CHECK(st.code() == ErrorCode::kCorrupt);
    CHECK(st.message() == "param name 'w\\x0a0123456789abcdef0123456789abcdef  (root)' holds a control character "
                          "(byte 1); names must be text");
  }
}

TEST_CASE("valid_utf8: RFC 3629, no surrogates, no overlong forms, nothing past U+10FFFF") {
  for (const char* good : {"", "layers.0.weight", "\xc3\xa9", "\xe2\x82\xac", "\xf0\x9f\x98\x80", "\xed\x9f\xbf",
                           "\xee\x80\x80", "\xf4\x8f\xbf\xbf"})
    CHECK_MESSAGE(utf8_error_at(good) < 0, good);
  const std::vector<std::pair<std::string, int64_t>> bad{
      {"a\x80", 1},          {"\xc0\xaf", 0},      {"\xc3", 0},          {"\xe0\x80\xaf", 0}, {"\xed\xa0\x80", 0},
      {"ab\xed\xbf\xbf", 2}, {"\xf0\x80\x80\xaf", 0}, {"\xf4\x90\x80\x80", 0}, {"\xf8\x88\x80\x80\x80", 0}, {"\xff", 0},
      {"\xe2\x82", 0}};
  for (const auto& b : bad) CHECK_MESSAGE(utf8_error_at(b.first) == b.second, b.first);  // no binding: clang 14 captures none
}

TEST_CASE("contained_path keeps checkpoint paths inside the checkpoint") {
  const std::filesystem::path root = "/ckpt";
  CHECK(contained_path(root, "data/rank-00000.bin").ok());
  for (const char* bad : {"../x", "/etc/passwd", "data/../../x", "a//b", "./a", "", "a\\b", "c:/x", "data/"})
    CHECK_MESSAGE(!contained_path(root, bad).ok(), bad);
}

TEST_CASE("InputFile reports truncation with the file name") {
  testing::TempDir dir;
  const std::string text = "hello";
  REQUIRE(write_small_file(dir.path / "f", std::as_bytes(std::span(text))).ok());
  auto f = InputFile::open(dir.path / "f");
  REQUIRE(f.ok());
  std::vector<std::byte> out(10);
  Status st = f->read_at(0, out);
  CHECK(st.code() == ErrorCode::kCorrupt);
  CHECK(st.message().find((dir.path / "f").string()) != std::string::npos);
  CHECK(InputFile::open(dir.path / "missing").status().code() == ErrorCode::kNotFound);
  CHECK(!read_small_file(dir.path / "f", 3).ok());  // over the cap: refused before allocating
}

TEST_CASE("OutputFile gathers small writes: the file holds every byte in order, patches land wherever the bytes are") {
  // Writes of every size around the gathering buffer (1 byte to 200 KiB), patches of bytes still
  // gathered, already handed to the kernel, and straddling both, zeros; the file equals the same
  // bytes built in memory, and offset() counts what was written, gathered or not.
  testing::TempDir dir;
  std::vector<std::byte> want;
  auto f = OutputFile::create(dir.path / "out");
  REQUIRE(f.ok());
  uint64_t seed = 7;
  auto next = [&] { return seed = seed * 6364136223846793005ULL + 1442695040888963407ULL; };
  const std::vector<size_t> sizes = {1, 30, 4096, 65535, 65536, 65537, 3, 200 << 10, 17, 100, 70000, 1, 0, 9};
  for (size_t round = 0; round < 3; ++round)
    for (size_t n : sizes) {
      std::vector<std::byte> bytes(n);
      for (auto& b : bytes) b = static_cast<std::byte>(next() >> 56);
      REQUIRE(f->write(bytes).ok());
      want.insert(want.end(), bytes.begin(), bytes.end());
      CHECK(f->offset() == want.size());
      // A patch of 8 bytes at a random place already written: gathered, handed over, or across.
      if (want.size() >= 8) {
        const uint64_t at = next() % (want.size() - 7);
        std::array<std::byte, 8> p{};
        for (auto& b : p) b = static_cast<std::byte>(next() >> 56);
        REQUIRE(f->patch(at, p).ok());
        std::copy(p.begin(), p.end(), want.begin() + static_cast<std::ptrdiff_t>(at));
      }
    }
  REQUIRE(f->write_zeros(5000).ok());
  want.resize(want.size() + 5000);
  CHECK(!f->patch(want.size() - 2, std::array<std::byte, 4>{}).ok());  // beyond what was written
  REQUIRE(f->sync_and_close().ok());
  auto got = read_small_file(dir.path / "out", want.size());
  REQUIRE(got.ok());
  CHECK(*got == want);
  CHECK(!f->write(std::array<std::byte, 1>{}).ok());  // closed
}

TEST_CASE("InputFile refuses a FIFO or a device where a file should be, without waiting on it") {
  // Opening a FIFO for reading blocks until some process opens it for writing: a checkpoint whose
  // data file is one must be refused, not hang validate or hash.
  testing::TempDir dir;
  const fs::path fifo = dir.path / "__0_0.distcp";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  auto f = InputFile::open(fifo);
  REQUIRE(!f.ok());
  CHECK(f.status().code() == ErrorCode::kCorrupt);
  CHECK(f.status().message() == fifo.string() + ": not a regular file");
  CHECK(!read_small_file(fifo, 1024).ok());
  CHECK(InputFile::open("/dev/zero").status().message() == "/dev/zero: not a regular file");
}

TEST_CASE("reads place bytes unskewed against the page cache, and skewed destinations read right") {
  // ReadBuffer: n bytes at the offset's position within a page, for any offset and size.
  ReadBuffer rb;
  for (uint64_t offset : {uint64_t{0}, uint64_t{1}, uint64_t{4095}, uint64_t{4096}, uint64_t{123456789}})
    for (size_t n : {size_t{1}, size_t{5000}, size_t{3} << 20}) {
      const auto s = rb.for_read(offset, n);
      CAPTURE(offset);
      CAPTURE(n);
      CHECK(s.size() == n);
      CHECK(!skewed_read(offset, s.data()));
      std::memset(s.data(), 0xab, s.size());  // all of it is writable (ASan checks the bounds)
    }
  CHECK(skewed_read(0, reinterpret_cast<void*>(16)));
  CHECK(skewed_read(4096 + 8, reinterpret_cast<void*>(8192 + 40)));
  CHECK(!skewed_read(16, reinterpret_cast<void*>(16)));
  CHECK(!skewed_read(0, reinterpret_cast<void*>(4096 - 16)));  // behind the source: no aliasing

  // read_at into skewed destinations goes through the bounce buffer, in pieces (more than its
  // 8 MiB), and reads the same bytes as an unskewed read; a short file is still an error.
  testing::TempDir dir;
  std::string text((size_t{9} << 20) + 777, '\0');
  uint32_t x = 12345;
  for (char& c : text) c = static_cast<char>((x = x * 1664525u + 1013904223u) >> 24);
  testing::write_file(dir.path / "f", text);
  auto f = InputFile::open(dir.path / "f");
  REQUIRE(f.ok());
  std::vector<std::byte> storage(text.size() + 2 * kPageBytes);
  const uintptr_t base = (reinterpret_cast<uintptr_t>(storage.data()) + kPageBytes - 1) / kPageBytes * kPageBytes;
  for (uint64_t offset : {uint64_t{0}, uint64_t{100}, uint64_t{4090}})
    for (size_t skew : {size_t{0}, size_t{1}, size_t{16}, size_t{63}, size_t{64}}) {
      const size_t n = text.size() - offset;
      std::byte* dst = reinterpret_cast<std::byte*>(base + (offset + skew) % kPageBytes);
      CAPTURE(offset);
      CAPTURE(skew);
      CHECK(skewed_read(offset, dst) == (skew > 0 && skew < 64));
      REQUIRE(f->read_at(offset, std::span(dst, n)).ok());
      CHECK(std::memcmp(dst, text.data() + offset, n) == 0);
    }
  std::byte* dst = reinterpret_cast<std::byte*>(base + 16);
  const Status st = f->read_at(1 << 20, std::span(dst, text.size()));  // past the end, skewed
  CHECK(st.code() == ErrorCode::kCorrupt);
  CHECK(st.message().find("truncated") != std::string::npos);
}

TEST_CASE("find_leftovers: a killed write's staging and moved-aside outputs, by name and dead process only") {
  testing::TempDir dir;
  namespace fs = std::filesystem;
  const std::string dead = "999999999";  // above any pid_max: no such process
  fs::create_directories(dir.path / (".ck.partial-" + dead + "-0000abcd") / "data");
  std::ofstream(dir.path / (".ck.partial-" + dead + "-0000abcd") / "data" / "f") << std::string(10, 'x');
  std::ofstream(dir.path / (".ck.old-" + dead)) << std::string(7, 'x');
  fs::create_directories(dir.path / (".ck.partial-" + std::to_string(::getpid()) + "-00000001"));  // this process
  fs::create_directories(dir.path / ".ck.partial-1-00000001");  // a running process (init)
  fs::create_directories(dir.path / (".other.partial-" + dead + "-00000001"));
  fs::create_directories(dir.path / ".ck.partial-abc");
  fs::create_directories(dir.path / "ck");
  const auto found = find_leftovers(dir.path / "ck");
  REQUIRE(found.size() == 2);
  CHECK(found[0].path == dir.path / (".ck.old-" + dead));
  CHECK(found[0].bytes == 7);
  CHECK(found[1].path == dir.path / (".ck.partial-" + dead + "-0000abcd"));
  CHECK(found[1].bytes == 10);
  CHECK(find_leftovers(dir.path / "nothing").empty());
}

namespace {
size_t open_descriptors() {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}
}  // namespace

TEST_CASE("InputFile keeps at most half the open-file limit open and reopens the same file on demand") {
  testing::TempDir dir;
  constexpr int kFiles = 150;
  for (int i = 0; i < kFiles; ++i) {
    std::ofstream f(dir.path / std::to_string(i), std::ios::binary);
    const std::string text = "file " + std::to_string(i) + std::string(static_cast<size_t>(i), '.');
    f << text;
  }
  rlimit saved{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &saved) == 0);
  const size_t base = open_descriptors();
  rlimit low = saved;
  low.rlim_cur = base + 48;  // far fewer than the files held open below
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &low) == 0);
  CHECK(max_open_inputs() == (base + 48) / 2);
  {
    std::vector<InputFile> files;
    for (int i = 0; i < kFiles; ++i) {
      auto f = InputFile::open(dir.path / std::to_string(i));
      REQUIRE(f.ok());
      files.push_back(std::move(*f));  // moved (vector growth too): the pool follows the file
    }
    CHECK(open_descriptors() <= base + max_open_inputs());
    for (int round = 0; round < 3; ++round)
      for (int i = 0; i < kFiles; i += (round + 1)) {
        std::string got(files[static_cast<size_t>(i)].size(), '\0');
        REQUIRE(files[static_cast<size_t>(i)].read_at(0, std::as_writable_bytes(std::span(got))).ok());
        CHECK(got == "file " + std::to_string(i) + std::string(static_cast<size_t>(i), '.'));
      }
    CHECK(open_descriptors() <= base + max_open_inputs());
    // File 0's descriptor was closed for others; replaced since, it is not read as if it were the same.
    {
      std::ofstream f(dir.path / "new", std::ios::binary);
      f << "file 0";
    }
    std::filesystem::rename(dir.path / "new", dir.path / "0");
    std::string got(6, '\0');
    const Status st = files[0].read_at(0, std::as_writable_bytes(std::span(got)));
    CHECK(st.code() == ErrorCode::kCorrupt);
    CHECK(st.message() == (dir.path / "0").string() + ": replaced or resized while it was being read");
  }
  CHECK(open_descriptors() == base);  // every descriptor closed with its file
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &saved) == 0);
}
