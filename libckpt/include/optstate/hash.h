// The state hash behind `optstate hash` (docs/hash.md has the byte-level definition and test vectors).
// Streams every byte through XXH3-128, so it runs in bounded memory and is independent of how the
// state was sharded, chunked or stored.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "optstate/checkpoint.h"

namespace optstate {

struct HashOptions {
  // Hash entries by their (dequantized) fp32 values instead of their stored encoding, so an 8-bit
  // checkpoint and its fp32 conversion agree (DESIGN §3.3).
  bool values = false;
  // Hash only the params this accepts (by fully qualified name; unset: every param). The root is
  // then the root of those params alone: what a checkpoint holding only them hashes to.
  std::function<bool(const std::string& fqn)> params;
};

struct StateHash {
  std::string root;                             // 32 lowercase hex digits
  std::map<std::string, std::string> entries;  // "<fqn>.<entry>" -> 32 hex digits
};

Result<StateHash> hash_checkpoint(CheckpointReader& reader, const HashOptions& options = {});
Result<StateHash> hash_state(const OptimizerState& state, const HashOptions& options = {});

// Resume validation: right after a load, is the live optimizer state exactly the checkpoint's?
// Compares the per-entry hashes and names every entry that is missing, extra or different.
struct ResumeCheck {
  std::vector<std::string> differences;  // empty when the live state is the checkpoint's
  bool ok() const { return differences.empty(); }
};
Result<ResumeCheck> verify_resume(const OptimizerState& live, CheckpointReader& saved);

// Building blocks, exposed for the test vectors in docs/hash.md.
std::string hyper_string(const Hyperparameters& h);
std::string double_bits_hex(double v);
std::string entry_header(const std::string& key, const ParamState& ps, const Hyperparameters& h, const Entry& e,
                         bool values_mode);

// XXH3-64 of a byte span as 16 lowercase hex digits: the chunk checksum of the native format.
std::string xxh3_64_hex(std::span<const std::byte> bytes);
uint64_t xxh3_64(std::span<const std::byte> bytes);
std::string u64_hex(uint64_t v);

}  // namespace optstate
