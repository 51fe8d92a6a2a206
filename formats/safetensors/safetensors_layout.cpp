#include "safetensors_layout.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <nlohmann/json.hpp>

#include "optstate/json_strict.h"
#include "optstate/state.h"

namespace optstate::safetensors {

using json = nlohmann::json;

uint64_t declared_header_length(std::span<const std::byte, 8> first8) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | static_cast<uint8_t>(first8[static_cast<size_t>(i)]);
  return n;
}

Result<uint64_t> parse_header_length(std::span<const std::byte> first8, uint64_t file_size, const std::string& where) {
  if (first8.size() < 8 || file_size < 8) return corrupt(fmt::format("{}: too short for a safetensors file", where));
  const uint64_t n = declared_header_length(first8.first<8>());
  if (n < 2) return corrupt(fmt::format("{}: header length {} out of range (2..{})", where, n, kMaxHeaderBytes));
  if (n > file_size - 8)
    return corrupt(fmt::format("{}: header of {} bytes does not fit in a file of {} bytes", where, n, file_size));
  if (n > kMaxHeaderBytes)
    return corrupt(fmt::format("{}: header of {} bytes, over the {} MiB every safetensors reader accepts (the "
                               "safetensors library's limit)",
                               where, n, kMaxHeaderBytes >> 20));
  return n;
}

Status check_header_size(uint64_t json_bytes, size_t tensors, size_t params, const std::string& where) {
  if (json_bytes <= kMaxHeaderBytes) return Status::Ok();
  return invalid_argument(fmt::format(
      "{}: the safetensors header of {} params ({} tensors) would be {} bytes, over the {} MiB every safetensors "
      "reader accepts (the safetensors library's limit, and optstate's); write this state as native, dcp or hdf5",
      where, params, tensors, json_bytes, kMaxHeaderBytes >> 20));
}

namespace {

// One tensor's entry of the header, {"dtype", "shape", "data_offsets"}, checked against the data buffer.
Status parse_tensor(const json& tj, uint64_t data_size, const std::string& tw, TensorInfo& t) {
  if (!tj.is_object()) return corrupt(tw + ": not an object");
  auto dt = tj.find("dtype");
  auto sh = tj.find("shape");
  auto off = tj.find("data_offsets");
  if (dt == tj.end() || !dt->is_string() || sh == tj.end() || !sh->is_array() || off == tj.end() ||
      !off->is_array() || off->size() != 2)
    return corrupt(tw + ": needs string 'dtype', array 'shape' and two 'data_offsets'");
  auto d = dtype_from_safetensors(dt->get<std::string>());
  if (!d) return corrupt(fmt::format("{}: dtype '{}' is not supported", tw, dt->get<std::string>()));
  t.dtype = *d;
  if (sh->size() > static_cast<size_t>(kMaxRank)) return corrupt(tw + ": too many dimensions");
  for (const json& dim : *sh) {
    if (!dim.is_number_unsigned()) return corrupt(tw + ": shape must hold non-negative integers");
    if (dim.get<uint64_t>() > static_cast<uint64_t>(kMaxNumel)) return corrupt(tw + ": dimension too large");
    t.shape.push_back(static_cast<int64_t>(dim.get<uint64_t>()));
  }
  auto numel = checked_numel(t.shape);
  if (!numel.ok()) return numel.status().with_context(tw);
  if (!(*off)[0].is_number_unsigned() || !(*off)[1].is_number_unsigned())
    return corrupt(tw + ": data_offsets must be non-negative integers");
  t.begin = (*off)[0].get<uint64_t>();
  t.end = (*off)[1].get<uint64_t>();
  if (t.begin > t.end || t.end > data_size)
    return corrupt(fmt::format("{}: bytes [{}, {}) lie outside the data buffer of {} bytes", tw, t.begin, t.end,
                               data_size));
  const uint64_t want = static_cast<uint64_t>(*numel) * dtype_size(t.dtype);
  if (t.end - t.begin != want)
    return corrupt(fmt::format("{}: holds {} bytes, its dtype and shape {} need {}", tw, t.end - t.begin,
                               format_shape(t.shape), want));
  return Status::Ok();
}

}  // namespace

Result<Header> parse_header(std::span<const std::byte> json_bytes, uint64_t data_size, const std::string& where) {
  const char* text = reinterpret_cast<const char*>(json_bytes.data());
  if (json_bytes.empty() || text[0] != '{') return corrupt(fmt::format("{}: header does not start with '{{'", where));
  std::optional<std::string> twice;
  std::string refused;
  Header h;
  h.data_start = 8 + json_bytes.size();
  // Each of the root's members as it is read (a tensor, or __metadata__); the first problem is kept
  // and reported after the checks of the whole text (a syntax error, a key twice), which come first.
  Status first_error = Status::Ok();
  bool metadata_seen = false;
  auto on_member = [&](std::string& name, json&& value) {
    if (name == "__metadata__") {
      if (std::exchange(metadata_seen, true)) {
        if (!twice) twice = name;
        return;
      }
      if (!first_error.ok()) return;
      if (!value.is_object()) {
        first_error = corrupt(where + ": __metadata__ is not an object");
        return;
      }
      for (auto& [k, v] : value.items()) {
        if (!v.is_string()) {
          first_error = corrupt(fmt::format("{}: __metadata__ '{}' is not a string", where, k));
          return;
        }
        h.metadata[k] = std::move(v.get_ref<std::string&>());
      }
      return;
    }
    auto [it, inserted] = h.tensors.try_emplace(std::move(name));
    if (!inserted) {
      if (!twice) twice = it->first;
      return;
    }
    if (first_error.ok())
      first_error = parse_tensor(value, data_size, fmt::format("{}: tensor '{}'", where, it->first), it->second);
  };
  const json root = parse_json_strict_members(text, text + json_bytes.size(), {}, on_member, twice, refused);
  if (!refused.empty()) return corrupt(fmt::format("{}: header {}", where, refused));
  if (root.is_discarded() || !root.is_object()) return corrupt(fmt::format("{}: header is not a JSON object", where));
  if (twice) return corrupt(fmt::format("{}: header names '{}' twice", where, printable(*twice)));
  OPTSTATE_RETURN_IF_ERROR(first_error);
  std::vector<const std::pair<const std::string, TensorInfo>*> order;  // into h.tensors (a map: they stay put)
  order.reserve(h.tensors.size());
  for (const auto& tensor : h.tensors) order.push_back(&tensor);
  // Coverage: sorted by offset, each tensor starts where the previous ended, and the last ends the
  // file (zero-size tensors may share an offset).
  std::sort(order.begin(), order.end(), [](const auto* a, const auto* b) {
    return std::tie(a->second.begin, a->second.end) < std::tie(b->second.begin, b->second.end);
  });
  uint64_t at = 0;
  for (const auto* tensor : order) {
    const auto& [name, t] = *tensor;
    if (t.begin != at)
      return corrupt(fmt::format("{}: tensor '{}' starts at byte {} of the data buffer, expected {} ({})", where, name,
                                 t.begin, at, t.begin > at ? "a hole" : "an overlap"));
    at = t.end;
  }
  if (at != data_size)
    return corrupt(fmt::format("{}: the tensors cover {} bytes of a {}-byte data buffer", where, at, data_size));
  return h;
}

std::string encode_header(const std::vector<std::pair<std::string, TensorInfo>>& tensors,
                          const std::map<std::string, std::string>& metadata) {
  // The object is written key by key so that the header lists tensors in file order (nlohmann's
  // ordered_json would keep that order too, but finds each key by a linear scan: quadratic in the
  // tensors, 12 s for 90,000 of them).
  using json = nlohmann::json;
  std::string text = "{";
  auto key = [&](const std::string& k) {
    if (text.size() > 1) text += ',';
    text += json(k).dump();
    text += ':';
  };
  if (!metadata.empty()) {
    key("__metadata__");
    text += json(metadata).dump();
  }
  for (const auto& [name, t] : tensors) {  // each tensor's keys in the order safetensors writes them
    key(name);
    text += R"({"dtype":)" + json(dtype_info(t.dtype).safetensors_name).dump() + R"(,"shape":)" + json(t.shape).dump() +
            R"(,"data_offsets":)" + json({t.begin, t.end}).dump() + "}";
  }
  text += '}';
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + text;
}

}  // namespace optstate::safetensors
