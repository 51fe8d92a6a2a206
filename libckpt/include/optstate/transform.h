// Whole-state conversions between encodings (convert --to fp32|8bit, dequantize-on-save). They change
// encodings only: the optimizer kind, steps and hyperparameters stay, so 8-bit -> fp32 -> 8-bit gives
// back the same state, raw hash included.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "optstate/state.h"

namespace optstate {

// Every blockwise8 entry becomes a dense fp32 entry with its dequantized values.
Result<OptimizerState> dequantize_state(const OptimizerState& in);

struct QuantizeOptions {
  int64_t block_size = 256;
  int64_t min_8bit_size = 4096;  // params with fewer global elements keep dense state
  // Params whose element count is no multiple of block_size keep dense state too (torchao's rule:
  // it quantizes tensor.view(-1, block_size), so it has no partial block).
  bool whole_blocks = false;
  // 8-bit moments of another block size or map are requantized in blocks of block_size (where
  // dense ones would be quantized), instead of kept: `convert --to 8bit --block-size N` given N.
  // The same codes as dequantizing first and quantizing that (the two steps it replaces).
  bool reblock = false;
};
// Dense moment entries (exp_avg: dynamic-signed; exp_avg_sq, max_exp_avg_sq: dynamic-unsigned) of
// params with at least min_8bit_size elements become blockwise8 (requantize_blockwise, so an entry
// that came from 8-bit gets its codes back). Entries already 8-bit are kept (requantized with
// `reblock` where their blocks or map differ).
// The result is AdamW8bit's state (kind "adamw8bit") once any entry is 8-bit, as the DCP and
// torch.save readers infer it from the entries: 8-bit -> dense -> 8-bit through them keeps the hash.
Result<OptimizerState> quantize_state(const OptimizerState& in, const QuantizeOptions& options = {});
// Whether any entry of `state` is blockwise8.
bool has_blockwise8(const OptimizerState& state);

// The same conversions entry by entry, for writers that take one entry at a time (convert streams:
// it never holds the whole state). kDequantize is dequantize_state's rule, kQuantize quantize_state's.
enum class Recode { kKeep, kDequantize, kQuantize };
// The metadata entry `name` (of a param of `numel` elements) gets; buffers left empty.
Entry recode_meta(const std::string& name, const Entry& e, int64_t numel, Recode how, const QuantizeOptions& q);
// Entry `name` with its buffers filled, recoded; `key` names it in errors. The options are checked
// by check_quantize_options first.
Result<Entry> recode_entry(const std::string& name, const Entry& e, int64_t numel, Recode how,
                           const QuantizeOptions& q, const std::string& key);
Status check_quantize_options(const QuantizeOptions& q);

// Dense values of a float dtype widened (or narrowed, f64) to fp32; `key` names the entry in errors.
Result<std::vector<float>> dense_to_f32(std::span<const std::byte> bytes, DType dtype, const std::string& key);
// The same into `out`, which must hold exactly as many floats as `bytes` holds values of `dtype`.
Status dense_to_f32_into(std::span<const std::byte> bytes, DType dtype, std::span<float> out, const std::string& key);
// The fp32 values of entry `e` (buffers filled) of a param of `numel` elements: dense values
// widened, blockwise8 ones dequantized (map[code] * absmax[block]). The writers of formats that keep
// some entries as fp32 values (torch.save, bitsandbytes' and torchao's 32-bit state).
Result<std::vector<float>> entry_f32_values(const Entry& e, int64_t numel, const std::string& key);
// The same values without a copy where they are fp32 already (a view of e.values); else converted
// into `scratch`, which grows to the largest entry and is reused from call to call (the writers that
// stream entry after entry: no allocation, page faults and copy per entry). Valid while e and
// scratch are.
Result<std::span<const float>> entry_f32_span(const Entry& e, int64_t numel, const std::string& key,
                                              std::vector<float>& scratch);

}  // namespace optstate
