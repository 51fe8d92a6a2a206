// The zstd decoder behind DCP's stream.zstd items (optstate/zstd.h) and the made InputFiles that
// hold decoded items (optstate/io.h): frames made here with libzstd's own encoder.
#include <doctest/doctest.h>

#include <cstring>
#include <string>
#include <vector>

#include "optstate/io.h"
#include "optstate/zstd.h"
#include "test_helpers.h"

#ifdef OPTSTATE_HAVE_ZSTD
#include <zstd.h>
#endif

using namespace optstate;
using namespace optstate::testing;

namespace {

std::vector<std::byte> as_bytes(const std::string& s) {
  std::vector<std::byte> out(s.size());
  std::memcpy(out.data(), s.data(), s.size());
  return out;
}

}  // namespace

#ifdef OPTSTATE_HAVE_ZSTD

namespace {

// Compressible but not trivial: a counter's text, so a frame is much smaller than what it decodes to.
std::string sample_text(size_t n) {
  std::string s;
  for (size_t i = 0; s.size() < n; ++i) s += std::to_string(i * 2654435761u % 100003) + ",";
  s.resize(n);
  return s;
}

std::string compress(const std::string& in, int level = 3) {
  std::string out(ZSTD_compressBound(in.size()), '\0');
  const size_t n = ZSTD_compress(out.data(), out.size(), in.data(), in.size(), level);
  REQUIRE_FALSE(ZSTD_isError(n));
  out.resize(n);
  return out;
}

// A frame as a streaming encoder writes it (no content size in its header), as torch's writer does.
std::string compress_streamed(const std::string& in) {
  ZSTD_CCtx* c = ZSTD_createCCtx();
  std::string out(ZSTD_compressBound(in.size()) + 64, '\0');
  ZSTD_inBuffer ib{in.data(), in.size(), 0};
  ZSTD_outBuffer ob{out.data(), out.size(), 0};
  size_t left;
  do {
    left = ZSTD_compressStream2(c, &ob, &ib, ZSTD_e_end);
    REQUIRE_FALSE(ZSTD_isError(left));
  } while (left != 0);
  ZSTD_freeCCtx(c);
  out.resize(ob.pos);
  return out;
}

Result<ByteVector> decode(const std::string& in, uint64_t cap, size_t piece) {
  ZstdDecoder d(cap, "item 'x'");
  for (size_t at = 0; at < in.size(); at += piece) {
    const auto part = as_bytes(in.substr(at, piece));
    OPTSTATE_RETURN_IF_ERROR(d.feed(part));
  }
  return d.finish();
}

std::string text_of(const ByteVector& b) { return std::string(reinterpret_cast<const char*>(b.data()), b.size()); }

}  // namespace

TEST_CASE("zstd: frames decode to what was encoded, whatever the pieces they arrive in") {
  CHECK(zstd_available());
  const std::string text = sample_text(300000);
  for (const std::string& frame : {compress(text), compress_streamed(text), compress(text, 19)}) {
    CHECK(frame.size() < text.size() / 2);
    for (size_t piece : {size_t{1} << 30, size_t{4096}, size_t{7}}) {
      auto got = decode(frame, 1 << 20, piece);
      REQUIRE(got.ok());
      CHECK(text_of(*got) == text);
    }
  }
  // A size hint only sizes the first buffer: short of, exactly at or past the output, the same bytes.
  for (uint64_t hint : {uint64_t{0}, uint64_t{1000}, uint64_t{text.size()}, uint64_t{text.size() * 3}}) {
    ZstdDecoder d(1 << 20, "item 'x'", hint);
    REQUIRE(d.feed(as_bytes(compress_streamed(text))).ok());
    auto got = d.finish();
    REQUIRE(got.ok());
    CHECK(text_of(*got) == text);
  }
  // One byte at a time through a small frame, and an empty frame (a zero-byte item's).
  auto small = decode(compress("hello"), 100, 1);
  REQUIRE(small.ok());
  CHECK(text_of(*small) == "hello");
  auto empty = decode(compress(""), 100, 1 << 20);
  REQUIRE(empty.ok());
  CHECK(empty->empty());
}

TEST_CASE("zstd: concatenated frames and skippable frames read as one stream") {
  const std::string a = sample_text(5000), b = "second frame";
  // A skippable frame: magic 0x184D2A50, a 4-byte size, that many bytes of anything.
  std::string skip = std::string("\x50\x2a\x4d\x18\x03\x00\x00\x00", 8) + "abc";
  auto got = decode(compress(a) + skip + compress_streamed(b), 1 << 20, 1000);
  REQUIRE(got.ok());
  CHECK(text_of(*got) == a + b);
}

TEST_CASE("zstd: a hostile stream is an error naming it, never more than the cap") {
  const std::string text = sample_text(100000);
  const std::string frame = compress_streamed(text);
  SUBCASE("cut short") {
    auto got = decode(frame.substr(0, frame.size() - 3), 1 << 20, 512);
    REQUIRE_FALSE(got.ok());
    CHECK(got.status().message().find("item 'x'") != std::string::npos);
    CHECK(got.status().message().find("ends inside a frame") != std::string::npos);
  }
  SUBCASE("bytes after the last frame") {
    auto got = decode(frame + "garbage!", 1 << 20, 512);
    REQUIRE_FALSE(got.ok());
    CHECK(got.status().message().find("not a valid zstd stream") != std::string::npos);
  }
  SUBCASE("not zstd at all") {
    auto got = decode("PK\x03\x04 a zip where a frame should be", 1 << 20, 512);
    REQUIRE_FALSE(got.ok());
    CHECK(got.status().code() == ErrorCode::kCorrupt);
  }
  SUBCASE("a damaged block") {
    std::string bad = frame;
    for (size_t i = frame.size() / 2; i < frame.size() / 2 + 16; ++i) bad[i] = static_cast<char>(bad[i] ^ 0x5a);
    auto got = decode(bad, 1 << 20, 512);
    // Either libzstd finds the block malformed, or it decodes other bytes: then the caller's CRC
    // (a torch.save record's) finds them. Never a crash, never past the cap.
    if (got.ok()) CHECK(got->size() <= (1u << 20));
  }
  SUBCASE("decodes to more than the cap") {
    auto at_cap = decode(frame, text.size(), 4096);
    REQUIRE(at_cap.ok());
    CHECK(at_cap->size() == text.size());
    auto over = decode(frame, text.size() - 1, 4096);
    REQUIRE_FALSE(over.ok());
    CHECK(over.status().message().find("more than 99999 bytes") != std::string::npos);
    // A small frame of zeros that claims to decode to far more (a "bomb") stops at the cap.
    const std::string bomb = compress(std::string(size_t{64} << 20, '\0'));
    CHECK(bomb.size() < 10000);
    auto stopped = decode(bomb, size_t{1} << 20, 1 << 20);
    REQUIRE_FALSE(stopped.ok());
    CHECK(stopped.status().message().find("more than 1048576 bytes") != std::string::npos);
  }
  SUBCASE("empty") {
    auto got = decode("", 100, 10);
    REQUIRE_FALSE(got.ok());
    CHECK(got.status().message().find("empty") != std::string::npos);
  }
}

TEST_CASE("zstd: a stored range of a file decodes; one past the file's end is refused") {
  TempDir dir;
  const std::string text = sample_text(20000), frame = compress_streamed(text);
  write_file(dir.path / "data", "head" + frame + "tail");
  auto f = InputFile::open(dir.path / "data");
  REQUIRE(f.ok());
  auto got = zstd_decode_range(*f, 4, frame.size(), 1 << 20, "item 'y'");
  REQUIRE(got.ok());
  CHECK(text_of(*got) == text);
  auto past = zstd_decode_range(*f, 4, frame.size() + 5, 1 << 20, "item 'y'");
  REQUIRE_FALSE(past.ok());
  CHECK(past.status().message().find("beyond the end") != std::string::npos);
}

#else

TEST_CASE("zstd: a build without libzstd refuses, saying so") {
  CHECK_FALSE(zstd_available());
  ZstdDecoder d(100, "item 'x'");
  const auto st = d.feed(as_bytes("x"));
  CHECK(st.code() == ErrorCode::kUnsupported);
  CHECK(st.message().find("without zstd") != std::string::npos);
}

#endif

TEST_CASE("made InputFiles: read like files, let go under the budget and made again") {
  int made_a = 0, made_b = 0;
  auto maker = [](int& count, std::string text) {
    return [&count, text]() -> Result<ByteVector> {
      ++count;
      const auto b = as_bytes(text);
      return ByteVector(b.begin(), b.end());
    };
  };
  const std::string ta(3000, 'a'), tb(2000, 'b');
  const uint64_t before = set_made_input_budget(4000);
  {
    auto a = InputFile::made("a (decoded)", maker(made_a, ta));
    REQUIRE(a.ok());
    CHECK(a->size() == 3000);
    CHECK(made_a == 1);
    std::vector<std::byte> out(10);
    REQUIRE(a->read_at(2990, out).ok());
    CHECK(out[9] == std::byte{'a'});
    CHECK(made_a == 1);  // held: no second make
    // b's 2000 bytes pass the 4000-byte budget: a, read least recently, is let go.
    auto b = InputFile::made("b (decoded)", maker(made_b, tb));
    REQUIRE(b.ok());
    REQUIRE(a->read_at(0, out).ok());
    CHECK(made_a == 2);  // made again
    CHECK(out[0] == std::byte{'a'});
    // Past the end: an error naming the file, as for a file on disk.
    const auto past = a->read_at(2995, out);
    REQUIRE_FALSE(past.ok());
    CHECK(past.message().find("a (decoded)") != std::string::npos);
  }
  {
    // Made again at another size: an error, not other bytes.
    int calls = 0;
    auto shrinking = [&calls]() -> Result<ByteVector> {
      ++calls;
      return ByteVector(calls == 1 ? 3000 : 10);
    };
    auto c = InputFile::made("c (decoded)", shrinking);
    REQUIRE(c.ok());
    set_made_input_budget(1000);  // c alone is over it: let go when another is made
    int made_d = 0;
    auto d = InputFile::made("d (decoded)", maker(made_d, std::string(500, 'd')));
    REQUIRE(d.ok());
    std::vector<std::byte> out(4);
    const auto st = c->read_at(0, out);
    REQUIRE_FALSE(st.ok());
    CHECK(st.message().find("made again as 10 bytes, 3000 before") != std::string::npos);
  }
  {
    // A maker's error is the file's.
    auto e = InputFile::made("e", []() -> Result<ByteVector> { return corrupt("e: broken"); });
    REQUIRE_FALSE(e.ok());
    CHECK(e.status().message() == "e: broken");
  }
  set_made_input_budget(before);
}
