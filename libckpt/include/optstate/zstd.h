// Zstandard (RFC 8878) decoding, as PyTorch DCP's `stream.zstd` items need it: a pure decoder fed
// byte spans, and a reader that feeds it one stored item from a file. Treats its input as hostile:
// the output is capped, a stream that ends inside a frame is an error, and so is anything after
// the last frame that is not another frame.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "optstate/io.h"
#include "optstate/status.h"

namespace optstate {

// Whether this build decodes zstd (OPTSTATE_WITH_ZSTD found libzstd); when not, every call below
// fails with kUnsupported, saying so.
bool zstd_available();

// Decodes one or more concatenated zstd frames (skippable frames skipped), fed in pieces.
class ZstdDecoder {
 public:
  // `max_out`: the most bytes the stream may decode to; `size_hint`: how many it is expected to
  // (room for them is taken at once, so a stream that size is decoded without regrowing);
  // `where` names it in errors.
  ZstdDecoder(uint64_t max_out, std::string where, uint64_t size_hint = 0);
  ~ZstdDecoder();
  ZstdDecoder(const ZstdDecoder&) = delete;
  ZstdDecoder& operator=(const ZstdDecoder&) = delete;

  Status feed(std::span<const std::byte> in);
  // The decoded bytes; an error where the input stopped inside a frame or held none.
  Result<ByteVector> finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Decodes `length` bytes of `file` at `offset` (a stored item) in pieces.
Result<ByteVector> zstd_decode_range(const InputFile& file, uint64_t offset, uint64_t length, uint64_t max_out,
                                     const std::string& where, uint64_t size_hint = 0);

}  // namespace optstate
