// SHA-256 (FIPS 180-4), for the whole-file digests other writers keep beside their data
// (Megatron-Core's integrity.json): a streaming digest over byte spans, no I/O.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace optstate {

class Sha256 {
 public:
  // The x86 SHA extensions (SHA-NI: ~6x the portable code here, as OpenSSL's hashlib) where the CPU
  // has them, else the portable rounds; kPortable forces the latter (tests run both).
  enum class Impl { kBest, kPortable };
  explicit Sha256(Impl impl = Impl::kBest);
  static bool sha_ni_available();
  void update(std::span<const std::byte> bytes);
  // The digest of everything updated so far; the object is spent afterwards.
  std::array<uint8_t, 32> finish();
  // finish() as 64 lowercase hex digits (as hashlib's hexdigest() and sha256sum print it).
  std::string finish_hex();

 private:
  using Compress = void (*)(uint32_t* h, const uint8_t* p, size_t blocks);
  Compress compress_;
  std::array<uint32_t, 8> h_;
  std::array<uint8_t, 64> buf_{};
  size_t used_ = 0;
  uint64_t length_ = 0;  // bytes
};

std::string sha256_hex(std::span<const std::byte> bytes);

}  // namespace optstate
