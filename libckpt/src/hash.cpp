#include "optstate/hash.h"

#include "optstate/values.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace optstate {
namespace {

std::string digest_hex(XXH128_hash_t h) {
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, h);
  std::string out;
  out.reserve(32);
  for (unsigned char b : c.digest) out += fmt::format("{:02x}", b);
  return out;
}

struct Xxh3State {
  XXH3_state_t* s = XXH3_createState();
  Xxh3State() { XXH3_128bits_reset(s); }
  ~Xxh3State() { XXH3_freeState(s); }
  Xxh3State(const Xxh3State&) = delete;
  void update(std::span<const std::byte> b) { XXH3_128bits_update(s, b.data(), b.size()); }
  void update(std::string_view t) { XXH3_128bits_update(s, t.data(), t.size()); }
  std::string hex() const { return digest_hex(XXH3_128bits_digest(s)); }
};

}  // namespace

std::string u64_hex(uint64_t v) { return fmt::format("{:016x}", v); }
uint64_t xxh3_64(std::span<const std::byte> bytes) { return XXH3_64bits(bytes.data(), bytes.size()); }
std::string xxh3_64_hex(std::span<const std::byte> bytes) { return u64_hex(xxh3_64(bytes)); }

std::string double_bits_hex(double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, 8);
  return u64_hex(bits);
}

std::string hyper_string(const Hyperparameters& h) {
  return fmt::format("lr:{},beta1:{},beta2:{},eps:{},weight_decay:{},amsgrad:{},maximize:{}", double_bits_hex(h.lr),
                     double_bits_hex(h.beta1), double_bits_hex(h.beta2), double_bits_hex(h.eps),
                     double_bits_hex(h.weight_decay), h.amsgrad ? 1 : 0, h.maximize ? 1 : 0);
}

std::string entry_header(const std::string& key, const ParamState& ps, const Hyperparameters& h, const Entry& e,
                         bool values_mode) {
  std::string enc;
  if (values_mode)
    enc = "values-f32";
  else if (e.encoding == Encoding::kDense)
    enc = fmt::format("dense,dtype={}", dtype_name(e.dtype));
  else
    enc = fmt::format("blockwise8,block_size={},qmap={}", e.block_size, e.qmap);
  return fmt::format("optstate-entry-v1\nname={}\nshape={}\nstep={}\nhyper={}\nencoding={}\n\n", key,
                     fmt::join(ps.shape, ","), ps.step, hyper_string(h), enc);
}

Result<StateHash> hash_checkpoint(CheckpointReader& reader, const HashOptions& options) {
  const OptimizerState& meta = reader.meta();
  OPTSTATE_RETURN_IF_ERROR(check_structure(meta, false).with_context(reader.path().string()));

  struct Item {
    std::string key;
    const std::string* fqn;
    const std::string* entry;
  };
  const auto selected = [&](const std::string& fqn) { return !options.params || options.params(fqn); };
  std::vector<Item> items;
  for (const auto& [fqn, ps] : meta.params)
    if (selected(fqn))
      for (const auto& [name, e] : ps.entries) items.push_back({entry_key(fqn, name), &fqn, &name});
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.key < b.key; });

  StateHash out;
  for (const Item& it : items) {
    const ParamState& ps = meta.params.at(*it.fqn);
    const Entry& e = ps.entries.at(*it.entry);
    const Hyperparameters& hyper = meta.groups[ps.group].hyper;
    Xxh3State h;
    h.update(entry_header(it.key, ps, hyper, e, options.values));
    if (!options.values) {
      for (Component c : e.components())
        OPTSTATE_RETURN_IF_ERROR(reader.stream(*it.fqn, *it.entry, c, [&](std::span<const std::byte> piece) {
          h.update(piece);
          return Status::Ok();
        }));
    } else {
      OPTSTATE_RETURN_IF_ERROR(stream_f32_values(reader, *it.fqn, *it.entry, [&](std::span<const float> v) {
        h.update(std::as_bytes(v));
        return Status::Ok();
      }));
    }
    out.entries[it.key] = h.hex();
  }

  Xxh3State root;
  root.update(fmt::format("optstate-root-v1\nmode={}\n", options.values ? "values" : "raw"));
  if (!options.values) root.update(fmt::format("kind={}\n", meta.kind));
  for (const auto& [fqn, ps] : meta.params)
    if (selected(fqn))
      root.update(fmt::format("param {} shape={} dtype={} step={} hyper={}\n", fqn, fmt::join(ps.shape, ","),
                              dtype_name(ps.param_dtype), ps.step, hyper_string(meta.groups[ps.group].hyper)));
  for (const Item& it : items) root.update(fmt::format("{}  {}\n", out.entries[it.key], it.key));
  out.root = root.hex();
  return out;
}

Result<ResumeCheck> verify_resume(const OptimizerState& live, CheckpointReader& saved) {
  OPTSTATE_ASSIGN_OR_RETURN(StateHash a, hash_state(live));
  OPTSTATE_ASSIGN_OR_RETURN(StateHash b, hash_checkpoint(saved));
  ResumeCheck r;
  for (const auto& [key, hex] : b.entries) {
    auto it = a.entries.find(key);
    if (it == a.entries.end())
      r.differences.push_back(fmt::format("entry '{}' is in {} but not in the live state", key, saved.path().string()));
    else if (it->second != hex)
      r.differences.push_back(fmt::format("entry '{}' differs: live {}, {} {}", key, it->second,
                                          saved.path().string(), hex));
  }
  for (const auto& [key, hex] : a.entries)
    if (!b.entries.count(key))
      r.differences.push_back(fmt::format("entry '{}' is live but not in {}", key, saved.path().string()));
  if (r.differences.empty() && a.root != b.root)  // steps, hyperparameters or kind of params without entries
    r.differences.push_back(fmt::format("root differs (params, steps, hyperparameters or kind): live {}, {} {}",
                                        a.root, saved.path().string(), b.root));
  return r;
}

Result<StateHash> hash_state(const OptimizerState& state, const HashOptions& options) {
  OPTSTATE_RETURN_IF_ERROR(check_structure(state, true));
  auto reader = memory_reader(state);
  return hash_checkpoint(*reader, options);
}

}  // namespace optstate
