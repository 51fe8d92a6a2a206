#include "optstate/zstd.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#ifdef OPTSTATE_HAVE_ZSTD
#include <zstd.h>
#endif

namespace optstate {

namespace {
constexpr size_t kInputPieceBytes = size_t{4} << 20;
}  // namespace

#ifdef OPTSTATE_HAVE_ZSTD

bool zstd_available() { return true; }

struct ZstdDecoder::Impl {
  ZSTD_DCtx* ctx = nullptr;
  uint64_t max_out = 0;
  std::string where;
  ByteVector out;
  size_t used = 0;        // bytes of `out` decoded so far
  size_t last_hint = 0;   // ZSTD_decompressStream's last return: 0 once a frame is whole and flushed
  bool any_input = false;
  Status failed;
};

ZstdDecoder::ZstdDecoder(uint64_t max_out, std::string where, uint64_t size_hint) : impl_(std::make_unique<Impl>()) {
  impl_->max_out = max_out;
  impl_->where = std::move(where);
  // Room for the expected bytes and one more, so a stream of exactly that size ends without a regrow.
  impl_->out.resize(static_cast<size_t>(std::min(max_out, size_hint + 1)));
  impl_->ctx = ZSTD_createDCtx();
  if (!impl_->ctx) impl_->failed = io_error(impl_->where + ": zstd: out of memory for a decoder");
}

ZstdDecoder::~ZstdDecoder() {
  if (impl_ && impl_->ctx) ZSTD_freeDCtx(impl_->ctx);
}

Status ZstdDecoder::feed(std::span<const std::byte> in) {
  Impl& d = *impl_;
  if (!d.failed.ok()) return d.failed;
  if (in.empty()) return Status::Ok();
  d.any_input = true;
  ZSTD_inBuffer ib{in.data(), in.size(), 0};
  while (ib.pos < ib.size || d.last_hint != 0) {
    if (d.used == d.out.size()) {
      if (d.out.size() >= d.max_out) {
        // Full: one more byte would pass the cap, unless the frame is done with what it has.
        std::byte probe[1];
        ZSTD_outBuffer ob{probe, 1, 0};
        const size_t r = ZSTD_decompressStream(d.ctx, &ob, &ib);
        if (ZSTD_isError(r))
          return d.failed = corrupt(fmt::format("{}: not a valid zstd stream ({})", d.where, ZSTD_getErrorName(r)));
        if (ob.pos > 0)
          return d.failed = corrupt(fmt::format("{}: decodes to more than {} bytes, the most it may hold", d.where,
                                                d.max_out));
        d.last_hint = r;
        if (ib.pos == ib.size) break;
        continue;
      }
      const uint64_t grown = std::max<uint64_t>(uint64_t{1} << 16, uint64_t{d.out.size()} * 2);
      d.out.resize(static_cast<size_t>(std::min(grown, d.max_out)));
    }
    ZSTD_outBuffer ob{d.out.data() + d.used, d.out.size() - d.used, 0};
    const size_t r = ZSTD_decompressStream(d.ctx, &ob, &ib);
    if (ZSTD_isError(r))
      return d.failed = corrupt(fmt::format("{}: not a valid zstd stream ({})", d.where, ZSTD_getErrorName(r)));
    d.used += ob.pos;
    d.last_hint = r;
    if (ib.pos == ib.size && ob.pos < ob.size) break;  // all input taken and nothing left to flush
  }
  return Status::Ok();
}

Result<ByteVector> ZstdDecoder::finish() {
  Impl& d = *impl_;
  if (!d.failed.ok()) return d.failed;
  if (!d.any_input) return corrupt(d.where + ": empty where a zstd stream should be");
  if (d.last_hint != 0) return corrupt(d.where + ": the zstd stream ends inside a frame (truncated)");
  // Given back only where much is unused (a copy of every byte): not after a good size hint.
  const bool shrink = d.out.size() - d.used > d.used / 4 + (size_t{1} << 20);
  d.out.resize(d.used);
  if (shrink) d.out.shrink_to_fit();
  return std::move(d.out);
}

#else  // no libzstd

bool zstd_available() { return false; }

struct ZstdDecoder::Impl {
  std::string where;
};
ZstdDecoder::ZstdDecoder(uint64_t, std::string where, uint64_t) : impl_(std::make_unique<Impl>()) {
  impl_->where = std::move(where);
}
ZstdDecoder::~ZstdDecoder() = default;
Status ZstdDecoder::feed(std::span<const std::byte>) {
  return unsupported(impl_->where + ": zstd-compressed, and this optstate was built without zstd (OPTSTATE_WITH_ZSTD "
                                    "found no libzstd)");
}
Result<ByteVector> ZstdDecoder::finish() {
  OPTSTATE_RETURN_IF_ERROR(feed({}));
  return ByteVector{};
}

#endif

Result<ByteVector> zstd_decode_range(const InputFile& file, uint64_t offset, uint64_t length, uint64_t max_out,
                                     const std::string& where, uint64_t size_hint) {
  if (offset > file.size() || length > file.size() - offset)
    return corrupt(fmt::format("{}: bytes [{}, {}) lie beyond the end of {} ({} bytes)", where, offset,
                               offset + length, file.path().string(), file.size()));
  ZstdDecoder dec(max_out, where, size_hint);
  std::vector<std::byte> piece(static_cast<size_t>(std::min<uint64_t>(length, kInputPieceBytes)));
  for (uint64_t at = 0; at < length;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(length - at, piece.size()));
    OPTSTATE_RETURN_IF_ERROR(file.read_at(offset + at, std::span(piece.data(), n)).with_context(where));
    OPTSTATE_RETURN_IF_ERROR(dec.feed(std::span<const std::byte>(piece.data(), n)));
    at += n;
  }
  return dec.finish();
}

}  // namespace optstate
