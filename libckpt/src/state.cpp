#include "optstate/state.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <sys/mman.h>

#include <cmath>
#include <cstring>
#include <new>

namespace optstate {

Buffer Buffer::copy_of(std::span<const std::byte> bytes) {
  return take(std::vector<std::byte>(bytes.begin(), bytes.end()));
}

Buffer Buffer::allocate(size_t size, std::span<std::byte>* out) {
  Buffer b;
  if (size >= (size_t{64} << 10)) {
    // Pages of its own: readers fill it with preads, whose copies are fastest unskewed (io.h; a
    // chunk of a native checkpoint starts on a page), and freeing it returns the memory at once
    // (aligned_alloc from the heap left convert's peak RSS at 2.7x, the heap fragmented).
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    auto* bytes = static_cast<std::byte*>(p);
    b.owner = std::shared_ptr<std::byte>(bytes, [size](std::byte* q) { ::munmap(q, size); });
    b.data = bytes;
    b.size = size;
    *out = {bytes, size};
    return b;
  }
  std::shared_ptr<std::byte[]> holder = std::make_shared_for_overwrite<std::byte[]>(size);
  b.data = holder.get();
  b.size = size;
  *out = {holder.get(), size};
  b.owner = std::move(holder);
  return b;
}

Buffer Buffer::take(std::vector<std::byte> bytes) {
  auto holder = std::make_shared<std::vector<std::byte>>(std::move(bytes));
  Buffer b;
  b.data = holder->data();
  b.size = holder->size();
  b.owner = std::move(holder);
  return b;
}

std::string_view encoding_name(Encoding e) { return e == Encoding::kDense ? "dense" : "blockwise8"; }

Result<Encoding> encoding_from_name(std::string_view name) {
  if (name == "dense") return Encoding::kDense;
  if (name == "blockwise8") return Encoding::kBlockwise8;
  return unsupported(fmt::format("unknown encoding '{}'", name));
}

std::string_view component_name(Component c) {
  switch (c) {
    case Component::kValues: return "values";
    case Component::kCodes: return "codes";
    case Component::kAbsmax: return "absmax";
  }
  return "?";
}

Result<Component> component_from_name(std::string_view name) {
  if (name == "values") return Component::kValues;
  if (name == "codes") return Component::kCodes;
  if (name == "absmax") return Component::kAbsmax;
  return corrupt(fmt::format("unknown component '{}'", name));
}

std::vector<Component> Entry::components() const {
  if (encoding == Encoding::kDense) return {Component::kValues};
  return {Component::kCodes, Component::kAbsmax};
}

const Buffer& Entry::buffer(Component c) const {
  return c == Component::kValues ? values : c == Component::kCodes ? codes : absmax;
}
Buffer& Entry::buffer(Component c) {
  return c == Component::kValues ? values : c == Component::kCodes ? codes : absmax;
}

Result<int64_t> checked_numel(const std::vector<int64_t>& shape) {
  if (shape.size() > static_cast<size_t>(kMaxRank))
    return corrupt(fmt::format("shape has {} dimensions (at most {})", shape.size(), kMaxRank));
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return corrupt(fmt::format("negative dimension in shape {}", format_shape(shape)));
    if (d != 0 && n > kMaxNumel / d)
      return corrupt(fmt::format("shape {} has more than 2^44 elements", format_shape(shape)));
    n *= d;
  }
  return n;
}

int64_t component_count(const Entry& e, Component c, int64_t numel) {
  if (c == Component::kAbsmax) return e.block_size > 0 ? (numel + e.block_size - 1) / e.block_size : 0;
  return numel;
}

int64_t component_elem_size(const Entry& e, Component c) {
  switch (c) {
    case Component::kValues: return dtype_size(e.dtype);
    case Component::kCodes: return 1;
    case Component::kAbsmax: return 4;
  }
  return 0;
}

int64_t component_bytes(const Entry& e, Component c, int64_t numel) {
  return component_count(e, c, numel) * component_elem_size(e, c);
}

namespace {
bool is_control(unsigned char c) { return c < 0x20 || c == 0x7F; }
}  // namespace

int64_t utf8_error_at(std::string_view s) {
  const auto* b = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    const unsigned c = b[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    // length and the range of the second byte (which rules out overlong forms, surrogates and
    // code points past U+10FFFF); later bytes are 0x80-0xBF
    size_t len = 0;
    unsigned lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    } else {
      return static_cast<int64_t>(i);
    }
    if (n - i < len || b[i + 1] < lo || b[i + 1] > hi) return static_cast<int64_t>(i);
    for (size_t k = 2; k < len; ++k)
      if (b[i + k] < 0x80 || b[i + k] > 0xBF) return static_cast<int64_t>(i);
    i += len;
  }
  return -1;
}

std::string printable(std::string_view s) {
  std::string out;
  while (!s.empty()) {
    const int64_t bad = utf8_error_at(s);
    const std::string_view good = s.substr(0, bad < 0 ? s.size() : static_cast<size_t>(bad));
    for (char ch : good) {
      const auto c = static_cast<unsigned char>(ch);
      if (is_control(c))
        out += fmt::format("\\x{:02x}", c);
      else
        out += ch;
    }
    if (bad < 0) break;
    out += fmt::format("\\x{:02x}", static_cast<unsigned char>(s[static_cast<size_t>(bad)]));
    s.remove_prefix(static_cast<size_t>(bad) + 1);
  }
  return out;
}

Status check_names(const OptimizerState& state) {
  auto check = [](const std::string& name) -> Status {
    const int64_t at = utf8_error_at(name);
    if (at >= 0)
      return corrupt(
          fmt::format("param name '{}' is not valid UTF-8 (byte {}); names must be text", printable(name), at));
    // A line break in a name would make `hash` print a line of its own choosing (a forged root).
    for (size_t i = 0; i < name.size(); ++i)
      if (is_control(static_cast<unsigned char>(name[i])))
        return corrupt(fmt::format("param name '{}' holds a control character (byte {}); names must be text",
                                   printable(name), i));
    return Status::Ok();
  };
  for (const auto& [fqn, ps] : state.params) OPTSTATE_RETURN_IF_ERROR(check(fqn));
  for (const auto& g : state.groups)
    for (const auto& fqn : g.params) OPTSTATE_RETURN_IF_ERROR(check(fqn));
  return Status::Ok();
}

std::optional<std::pair<const char*, double>> nonfinite_hyperparameter(const Hyperparameters& h) {
  for (const auto& [name, v] : {std::pair{"lr", h.lr}, std::pair{"betas[0]", h.beta1}, std::pair{"betas[1]", h.beta2},
                                std::pair{"eps", h.eps}, std::pair{"weight_decay", h.weight_decay}})
    if (!std::isfinite(v)) return std::pair{name, v};
  return std::nullopt;
}

Status check_structure(const OptimizerState& state, bool require_buffers) {
  OPTSTATE_RETURN_IF_ERROR(check_names(state));
  if (state.kind != "adamw" && state.kind != "adamw8bit")
    return unsupported(fmt::format("unknown optimizer kind '{}'", state.kind));
  for (const auto& [fqn, ps] : state.params) {
    if (ps.group < 0 || static_cast<size_t>(ps.group) >= state.groups.size())
      return corrupt(fmt::format("param '{}' refers to group {} of {}", fqn, ps.group, state.groups.size()));
    if (ps.step < 0) return corrupt(fmt::format("param '{}' has negative step {}", fqn, ps.step));
    OPTSTATE_ASSIGN_OR_RETURN(int64_t numel, checked_numel(ps.shape));
    for (const auto& [name, e] : ps.entries) {
      const std::string key = entry_key(fqn, name);
      if (e.encoding == Encoding::kBlockwise8) {
        if (e.block_size <= 0 || e.block_size > (int64_t{1} << 20))
          return corrupt(fmt::format("entry '{}' has block size {}", key, e.block_size));
        if (e.qmap != "dynamic-signed" && e.qmap != "dynamic-unsigned")
          return unsupported(fmt::format("entry '{}' names unknown quantization map '{}'", key, e.qmap));
      } else if (!dtype_info(e.dtype).is_float) {
        return corrupt(fmt::format("dense entry '{}' has non-float dtype {}", key, dtype_name(e.dtype)));
      }
      if (!require_buffers) continue;
      for (Component c : e.components()) {
        const int64_t want = component_bytes(e, c, numel);
        if (static_cast<int64_t>(e.buffer(c).size) != want)
          return invalid_argument(fmt::format("entry '{}' {} holds {} bytes, shape {} needs {}", key,
                                              component_name(c), e.buffer(c).size, format_shape(ps.shape), want));
      }
    }
  }
  for (size_t g = 0; g < state.groups.size(); ++g)
    for (const auto& fqn : state.groups[g].params) {
      auto it = state.params.find(fqn);
      if (it == state.params.end())
        return corrupt(fmt::format("group {} lists unknown param '{}'", g, fqn));
      if (it->second.group != static_cast<int>(g))
        return corrupt(fmt::format("param '{}' is listed in group {} but says group {}", fqn, g, it->second.group));
    }
  return Status::Ok();
}

FlatRange shard_range(const Entry& e, Component c, const std::vector<int64_t>& shape, int world, int rank) {
  const int64_t numel = *checked_numel(shape);
  const int64_t rows = shape.empty() ? 1 : shape[0];
  const int64_t row_len = rows > 0 ? numel / rows : 0;
  // What is split, torch.chunk-style (ceil-sized, trailing ranks short or empty): whole rows of dim 0
  // for dense entries, and for 8-bit ones where every rank's rows begin on a block (FSDP2's Shard(0)
  // layout, so an FSDP2 rank's local codes are its range); else whole blocks. Blocks never straddle
  // ranks, and a single rank gets everything either way.
  const bool eight = e.encoding == Encoding::kBlockwise8;
  const bool by_rows = !eight || (row_len > 0 && ((rows + world - 1) / world * row_len) % e.block_size == 0);
  const int64_t units = by_rows ? rows : (numel + e.block_size - 1) / e.block_size;
  const int64_t unit_elems = by_rows ? row_len : e.block_size;
  const int64_t per_rank = (units + world - 1) / world;
  const int64_t first = std::min<int64_t>(units, per_rank * rank), last = std::min<int64_t>(units, first + per_rank);
  const int64_t begin = std::min(numel, first * unit_elems), end = std::min(numel, last * unit_elems);
  // absmax in blocks: begin lies on a block (or at numel, for an empty shard)
  const int64_t b = e.block_size;
  if (eight && c == Component::kAbsmax) return {(begin + b - 1) / b, (end + b - 1) / b};
  return {begin, end};
}

std::string format_shape(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

std::optional<std::string> moment_of(const std::string& name, std::string_view suffix) {
  if (name.size() <= suffix.size() || name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
    return std::nullopt;
  std::string base = name.substr(0, name.size() - suffix.size());
  if (base != kExpAvg && base != kExpAvgSq && base != kMaxExpAvgSq) return std::nullopt;
  return base;
}

}  // namespace optstate
