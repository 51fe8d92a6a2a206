#include "optstate/validate.h"

#include <fmt/format.h>

#include <cstring>
#include <string_view>
#include <tuple>

#include "optstate/values.h"

namespace optstate {
namespace {

// Values that an AdamW state can never hold: non-finite anywhere, negative second moments.
void check_values(CheckpointReader& reader, const std::string& fqn, const std::string& name, ValidationReport& r) {
  const std::string key = entry_key(fqn, name);
  const bool second_moment = name == kExpAvgSq || name == kMaxExpAvgSq;
  int64_t index = 0, nonfinite = 0, negative = 0, first_bad = -1, first_negative = -1;
  Status st = stream_f32_values(reader, fqn, name, [&](std::span<const float> v) {
    for (float x : v) {
      if (!std::isfinite(x)) {
        if (nonfinite++ == 0) first_bad = index;
      } else if (second_moment && x < 0) {
        if (negative++ == 0) first_negative = index;
      }
      ++index;
    }
    return Status::Ok();
  });
  r.values_checked += index;
  if (!st.ok()) {
    r.findings.push_back({key, st.message()});
    return;
  }
  const Entry& e = reader.meta().params.at(fqn).entries.at(name);
  const Component where = e.encoding == Encoding::kDense ? Component::kValues : Component::kCodes;
  if (nonfinite)
    r.findings.push_back({key, fmt::format("{}: entry '{}' has {} non-finite values (first at element {})",
                                           reader.locate(fqn, name, where, first_bad), key, nonfinite, first_bad)});
  if (negative)
    r.findings.push_back({key, fmt::format("{}: entry '{}' has {} negative values (first at element {}); a second "
                                           "moment is never negative",
                                           reader.locate(fqn, name, where, first_negative), key, negative,
                                           first_negative)});
}

void check_absmax(CheckpointReader& reader, const std::string& fqn, const std::string& name, ValidationReport& r) {
  const std::string key = entry_key(fqn, name);
  int64_t block = 0, bad = 0, first = -1;
  float first_value = 0;
  Status st = reader.stream(fqn, name, Component::kAbsmax, [&](std::span<const std::byte> piece) {
    for (size_t i = 0; i + 4 <= piece.size(); i += 4, ++block) {
      float a;
      std::memcpy(&a, piece.data() + i, 4);
      // 0 is a block of zeros (any code times 0): bitsandbytes leaves the scale of a block that
      // never saw a gradient at 0, where torchao and optstate clamp it to 1e-12.
      if (!(a >= 0) || !std::isfinite(a)) {
        if (bad++ == 0) {
          first = block;
          first_value = a;
        }
      }
    }
    return Status::Ok();
  });
  if (!st.ok()) {
    r.findings.push_back({key, st.message()});
    return;
  }
  if (bad)
    r.findings.push_back({key, fmt::format("{}: entry '{}' has {} blocks whose absmax is not a finite "
                                           "number >= 0 (first: block {}, {})",
                                           reader.locate(fqn, name, Component::kAbsmax, first), key, bad, first,
                                           first_value)});
}

}  // namespace

Result<ValidationReport> validate_checkpoint(const std::filesystem::path& path, const OpenFn& open) {
  ValidationReport r;
  auto opened = open(path);
  if (!opened.ok()) {
    const ErrorCode c = opened.status().code();
    if (c == ErrorCode::kCorrupt || c == ErrorCode::kUnsupported) {
      r.findings.push_back({"", opened.status().message()});
      return r;
    }
    if (c == ErrorCode::kNotFound && std::filesystem::exists(path)) {  // e.g. a data file is missing
      r.findings.push_back({"", opened.status().message()});
      return r;
    }
    return opened.status();
  }
  CheckpointReader& reader = **opened;
  const OptimizerState& meta = reader.meta();
  Status structure = check_structure(meta, false);
  if (!structure.ok()) r.findings.push_back({"", fmt::format("{}: {}", path.string(), structure.message())});
  // A NaN or infinite hyperparameter (a diverged LR schedule) steps every param of its group to NaN.
  // Outside what torch.optim.AdamW takes (its constructor's checks): no run stepped with them.
  for (size_t g = 0; g < meta.groups.size(); ++g) {
    const Hyperparameters& h = meta.groups[g].hyper;
    if (const auto bad = nonfinite_hyperparameter(h)) {
      r.findings.push_back({"", fmt::format("{}: param group {}: {} is {}", path.string(), g, bad->first, bad->second)});
      continue;
    }
    for (const auto& [name, v, ok] : {std::tuple{"lr", h.lr, h.lr >= 0}, std::tuple{"eps", h.eps, h.eps >= 0},
                                      std::tuple{"weight_decay", h.weight_decay, h.weight_decay >= 0},
                                      std::tuple{"betas[0]", h.beta1, h.beta1 >= 0 && h.beta1 < 1},
                                      std::tuple{"betas[1]", h.beta2, h.beta2 >= 0 && h.beta2 < 1}})
      if (!ok)
        r.findings.push_back({"", fmt::format("{}: param group {}: {} is {}, outside what torch.optim.AdamW takes "
                                              "({})", path.string(), g, name, v,
                                              std::string_view(name).starts_with("betas") ? "0 <= beta < 1" : ">= 0")});
  }
  for (const auto& [fqn, ps] : meta.params) {
    const bool has_moments = ps.entries.count(kExpAvg) || ps.entries.count(kExpAvgSq);
    if (ps.entries.count(kExpAvg) != ps.entries.count(kExpAvgSq))
      r.findings.push_back({fqn, fmt::format("{}: param '{}' has only one of exp_avg and exp_avg_sq", path.string(),
                                             fqn)});
    if (has_moments && ps.step == 0)
      r.findings.push_back({fqn, fmt::format("{}: param '{}' has optimizer state but step 0", path.string(), fqn)});
    if (!has_moments && ps.step > 0)
      r.findings.push_back({fqn, fmt::format("{}: param '{}' is at step {} but has no optimizer state",
                                             path.string(), fqn, ps.step)});
    for (const auto& [name, e] : ps.entries) {
      ++r.entries_checked;
      // Reading the values streams every chunk, which verifies every checksum.
      check_values(reader, fqn, name, r);
      if (e.encoding == Encoding::kBlockwise8) check_absmax(reader, fqn, name, r);
    }
  }
  if (Status shared = reader.verify_shared_records(); !shared.ok()) r.findings.push_back({"", shared.message()});
  if (auto digests = reader.verify_file_digests(); digests.ok())
    r.file_digests = std::move(*digests);
  else
    r.findings.push_back({"", digests.status().message()});
  // Asked after every chunk was read: DCP knows only then whether each had a CRC-32 to check.
  r.checksums_verified = reader.checksummed();
  if (!r.checksums_verified) r.unchecked = reader.unchecked();
  return r;
}

}  // namespace optstate
