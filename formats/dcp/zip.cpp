#include "zip.h"

#include <fmt/format.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <array>
#include <cstring>
#include <set>

namespace optstate::zip {
namespace {

uint64_t le(std::span<const std::byte> b, size_t at, int n) {
  uint64_t v = 0;
  for (int k = n - 1; k >= 0; --k) v = v << 8 | static_cast<uint8_t>(b[at + static_cast<size_t>(k)]);
  return v;
}
void put(std::string& out, uint64_t v, int n) {
  for (int k = 0; k < n; ++k) out.push_back(static_cast<char>((v >> (8 * k)) & 0xff));
}

constexpr uint32_t kEocd = 0x06054b50, kZip64Eocd = 0x06064b50, kZip64Locator = 0x07064b50, kCentral = 0x02014b50,
                   kLocal = 0x04034b50;

}  // namespace

Result<CentralDirectory> find_central_directory(std::span<const std::byte> tail, uint64_t archive_size,
                                                const std::string& where) {
  if (tail.size() < 22 || tail.size() > archive_size) return corrupt(fmt::format("{}: too short for a zip archive", where));
  const uint64_t tail_start = archive_size - tail.size();
  // The EOCD is the last record; scan back over a possible comment.
  for (size_t at = tail.size() - 22 + 1; at-- > 0;) {
    if (le(tail, at, 4) != kEocd) continue;
    const uint64_t comment = le(tail, at + 20, 2);
    if (at + 22 + comment != tail.size()) continue;
    CentralDirectory cd;
    cd.count = le(tail, at + 10, 2);
    cd.size = le(tail, at + 12, 4);
    cd.offset = le(tail, at + 16, 4);
    if (cd.count == 0xffff || cd.size == 0xffffffff || cd.offset == 0xffffffff) {
      if (at < 20 || le(tail, at - 20, 4) != kZip64Locator)
        return corrupt(fmt::format("{}: ZIP64 end record expected but no locator", where));
      const uint64_t rec = le(tail, at - 20 + 8, 8);
      const uint64_t locator = tail_start + at - 20;  // the record's 56 bytes end before the locator
      if (rec < tail_start || rec > locator || locator - rec < 56)  // (rec + 56 would wrap for a hostile rec)
        return corrupt(fmt::format("{}: ZIP64 end record at {} lies outside the archive's tail", where, rec));
      const size_t r = static_cast<size_t>(rec - tail_start);
      if (le(tail, r, 4) != kZip64Eocd) return corrupt(fmt::format("{}: bad ZIP64 end record signature", where));
      cd.count = le(tail, r + 32, 8);
      cd.size = le(tail, r + 40, 8);
      cd.offset = le(tail, r + 48, 8);
    }
    if (cd.count > kMaxEntries) return corrupt(fmt::format("{}: {} zip entries (cap {})", where, cd.count, kMaxEntries));
    if (cd.offset > archive_size || cd.size > archive_size - cd.offset)
      return corrupt(fmt::format("{}: central directory [{}, {}) lies outside the {}-byte archive", where, cd.offset,
                                 cd.offset + cd.size, archive_size));
    return cd;
  }
  return corrupt(fmt::format("{}: no zip end-of-central-directory record (truncated or not a zip)", where));
}

Result<std::vector<Entry>> parse_central_directory(std::span<const std::byte> b, const CentralDirectory& cd,
                                                   const std::string& where, bool allow_compressed) {
  std::vector<Entry> out;
  std::set<std::string> names;
  size_t at = 0;
  for (uint64_t i = 0; i < cd.count; ++i) {
    if (b.size() - at < 46 || le(b, at, 4) != kCentral)
      return corrupt(fmt::format("{}: central directory record {} is damaged", where, i));
    Entry e;
    e.method = static_cast<uint16_t>(le(b, at + 10, 2));
    e.crc32 = static_cast<uint32_t>(le(b, at + 16, 4));
    uint64_t csize = le(b, at + 20, 4), usize = le(b, at + 24, 4);
    const size_t n = le(b, at + 28, 2), x = le(b, at + 30, 2), c = le(b, at + 32, 2);
    uint64_t offset = le(b, at + 42, 4);
    if (b.size() - at - 46 < n + x + c) return corrupt(fmt::format("{}: central directory record {} is truncated", where, i));
    e.name.assign(reinterpret_cast<const char*>(b.data()) + at + 46, n);
    // ZIP64 extra field: the 64-bit values of the fields that hold 0xffffffff, in order.
    for (size_t xa = at + 46 + n, xe = xa + x; xa + 4 <= xe;) {
      const uint64_t id = le(b, xa, 2), len = le(b, xa + 2, 2);
      if (xa + 4 + len > xe) return corrupt(fmt::format("{}: zip entry '{}' has a damaged extra field", where, e.name));
      if (id == 1) {
        size_t p = xa + 4;
        auto next = [&](uint64_t& v) -> bool {
          if (v != 0xffffffff) return true;
          if (p + 8 > xa + 4 + len) return false;
          v = le(b, p, 8);
          p += 8;
          return true;
        };
        if (!next(usize) || !next(csize) || !next(offset))
          return corrupt(fmt::format("{}: zip entry '{}' has a short ZIP64 field", where, e.name));
      }
      xa += 4 + len;
    }
    if (e.method != 0 && !allow_compressed)
      return corrupt(fmt::format("{}: zip entry '{}' is compressed (method {}); torch.save stores entries", where,
                                 e.name, e.method));
    if (e.method == 0 && csize != usize) return corrupt(fmt::format("{}: zip entry '{}' sizes disagree", where, e.name));
    e.size = csize;
    e.local_header_offset = offset;
    if (offset >= cd.offset || e.size > cd.offset - offset)
      return corrupt(fmt::format("{}: zip entry '{}' [{}, +{}) overlaps the central directory", where, e.name, offset,
                                 e.size));
    if (!names.insert(e.name).second) return corrupt(fmt::format("{}: zip entry '{}' appears twice", where, e.name));
    out.push_back(std::move(e));
    at += 46 + n + x + c;
  }
  return out;
}

Result<uint64_t> data_offset(std::span<const std::byte> h, const Entry& e, uint64_t cd_offset, const std::string& where) {
  if (h.size() < 30 || le(h, 0, 4) != kLocal)
    return corrupt(fmt::format("{}: zip entry '{}' has no local header at {}", where, e.name, e.local_header_offset));
  const uint64_t start = e.local_header_offset + 30 + le(h, 26, 2) + le(h, 28, 2);
  if (start > cd_offset || e.size > cd_offset - start)
    return corrupt(fmt::format("{}: zip entry '{}' data [{}, {}) runs into the central directory at {}", where, e.name,
                               start, start + e.size, cd_offset));
  return start;
}

namespace {

#if defined(__x86_64__)
// CRC-32 (zip's reflected polynomial 0xedb88320) of whole 16-byte blocks by carry-less
// multiplication, after Gopal et al., "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ"
// (Intel, 2009): four 128-bit lanes are folded forward 64 bytes at a time (x^(4*128+32) and
// x^(4*128-32) mod P), then into one lane, then 128 -> 64 bits and a Barrett reduction to 32. The
// constants are that paper's for this polynomial, in the bit-reflected domain. `state` and the
// result are the inverted CRC register; n >= 64, a multiple of 16.
#define OPTSTATE_CLMUL __attribute__((target("pclmul,sse4.1")))

OPTSTATE_CLMUL inline __m128i load(const uint8_t* at) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(at)); }

// x folded forward by k (its low and high halves multiplied apart) into the next block
OPTSTATE_CLMUL inline __m128i fold(__m128i x, __m128i k, __m128i next) {
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), next);
}

OPTSTATE_CLMUL uint32_t crc32_folded(const uint8_t* p, size_t n, uint32_t state) {
  const __m128i k1k2 = _mm_set_epi64x(0x01c6e41596, 0x0154442bd4);
  const __m128i k3k4 = _mm_set_epi64x(0x00ccaa009e, 0x01751997d0);
  const __m128i k5 = _mm_set_epi64x(0, 0x0163cd6124);
  const __m128i poly_mu = _mm_set_epi64x(0x01f7011641, 0x01db710641);
  __m128i a = _mm_xor_si128(load(p), _mm_cvtsi32_si128(static_cast<int>(state)));
  __m128i b = load(p + 16), c = load(p + 32), d = load(p + 48);
  p += 64;
  n -= 64;
  for (; n >= 64; p += 64, n -= 64) {
    a = fold(a, k1k2, load(p));
    b = fold(b, k1k2, load(p + 16));
    c = fold(c, k1k2, load(p + 32));
    d = fold(d, k1k2, load(p + 48));
  }
  a = fold(fold(fold(a, k3k4, b), k3k4, c), k3k4, d);
  for (; n >= 16; p += 16, n -= 16) a = fold(a, k3k4, load(p));
  // 128 -> 64 bits, then 64 -> 32 by Barrett reduction
  const __m128i low32 = _mm_setr_epi32(-1, 0, -1, 0);
  a = _mm_xor_si128(_mm_srli_si128(a, 8), _mm_clmulepi64_si128(a, k3k4, 0x10));
  a = _mm_xor_si128(_mm_srli_si128(a, 4), _mm_clmulepi64_si128(_mm_and_si128(a, low32), k5, 0x00));
  __m128i t = _mm_clmulepi64_si128(_mm_and_si128(a, low32), poly_mu, 0x10);
  t = _mm_clmulepi64_si128(_mm_and_si128(t, low32), poly_mu, 0x00);
  return static_cast<uint32_t>(_mm_extract_epi32(_mm_xor_si128(a, t), 1));
}

#undef OPTSTATE_CLMUL

bool has_clmul() {
  static const bool yes = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  return yes;
}
#endif

}  // namespace

uint32_t crc32(std::span<const std::byte> bytes, uint32_t crc) {
#if defined(__x86_64__)
  if (bytes.size() >= 64 && has_clmul()) {
    const size_t whole = bytes.size() & ~size_t{15};
    crc = ~crc32_folded(reinterpret_cast<const uint8_t*>(bytes.data()), whole, ~crc);
    bytes = bytes.subspan(whole);
  }
#endif
  return crc32_table(bytes, crc);
}

uint32_t crc32_table(std::span<const std::byte> bytes, uint32_t crc) {
  static const auto table = [] {
    std::array<std::array<uint32_t, 256>, 8> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = c & 1 ? 0xedb88320u ^ (c >> 1) : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
    return t;
  }();
  crc = ~crc;
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  size_t n = bytes.size();
  while (n >= 8) {  // slicing-by-8
    uint32_t a, b;
    std::memcpy(&a, p, 4);
    std::memcpy(&b, p + 4, 4);
    a ^= crc;
    crc = table[7][a & 0xff] ^ table[6][(a >> 8) & 0xff] ^ table[5][(a >> 16) & 0xff] ^ table[4][a >> 24] ^
          table[3][b & 0xff] ^ table[2][(b >> 8) & 0xff] ^ table[1][(b >> 16) & 0xff] ^ table[0][b >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) crc = table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
  return ~crc;
}

std::string Builder::local_header(const std::string& name, uint64_t size, uint32_t crc, uint64_t at, uint64_t align) {
  std::string h;
  put(h, kLocal, 4);
  put(h, 45, 2);  // version needed: ZIP64
  put(h, 0, 2);   // flags
  put(h, 0, 2);   // stored
  put(h, 0, 2);
  put(h, 0x21, 2);  // time, date (1980-01-01)
  put(h, crc, 4);
  put(h, 0xffffffff, 4);
  put(h, 0xffffffff, 4);
  put(h, name.size(), 2);
  const uint64_t base = at + 30 + name.size() + 20 + 4;  // after the ZIP64 field and a padding field header
  const uint64_t pad = (align - base % align) % align;
  put(h, 20 + 4 + pad, 2);
  h += name;
  put(h, 1, 2);  // ZIP64 extra: usize, csize
  put(h, 16, 2);
  put(h, size, 8);
  put(h, size, 8);
  put(h, 0xcafe, 2);  // padding field (ignored by readers), as torch's writer does for alignment
  put(h, pad, 2);
  h.append(pad, '\0');
  recs_.push_back({name, size, at, crc});
  return h;
}

std::string Builder::finish(uint64_t at) const {
  std::string cd;
  for (const Rec& r : recs_) {
    put(cd, kCentral, 4);
    put(cd, 45, 2);
    put(cd, 45, 2);
    put(cd, 0, 2);
    put(cd, 0, 2);
    put(cd, 0, 2);
    put(cd, 0x21, 2);
    put(cd, r.crc, 4);
    put(cd, 0xffffffff, 4);
    put(cd, 0xffffffff, 4);
    put(cd, r.name.size(), 2);
    put(cd, 28, 2);  // ZIP64 extra: usize, csize, offset
    put(cd, 0, 2);
    put(cd, 0, 2);
    put(cd, 0, 2);
    put(cd, 0, 4);
    put(cd, 0xffffffff, 4);
    cd += r.name;
    put(cd, 1, 2);
    put(cd, 24, 2);
    put(cd, r.size, 8);
    put(cd, r.size, 8);
    put(cd, r.offset, 8);
  }
  std::string out = cd;
  const uint64_t z64 = at + cd.size();
  put(out, kZip64Eocd, 4);
  put(out, 44, 8);
  put(out, 45, 2);
  put(out, 45, 2);
  put(out, 0, 4);
  put(out, 0, 4);
  put(out, recs_.size(), 8);
  put(out, recs_.size(), 8);
  put(out, cd.size(), 8);
  put(out, at, 8);
  put(out, kZip64Locator, 4);
  put(out, 0, 4);
  put(out, z64, 8);
  put(out, 1, 4);
  put(out, kEocd, 4);
  put(out, 0, 2);
  put(out, 0, 2);
  put(out, 0xffff, 2);
  put(out, 0xffff, 2);
  put(out, 0xffffffff, 4);
  put(out, 0xffffffff, 4);
  put(out, 0, 2);
  return out;
}

Status check_record_crc(std::span<const std::byte> bytes, const Entry& e, const std::string& where) {
  if (e.crc32 == 0) return Status::Ok();
  const uint32_t got = crc32(bytes);
  if (got == e.crc32) return Status::Ok();
  return corrupt(fmt::format("{}: CRC-32 of record '{}' is {:08x}, the archive records {:08x}: the file is damaged",
                             where, e.name, got, e.crc32));
}

}  // namespace optstate::zip
