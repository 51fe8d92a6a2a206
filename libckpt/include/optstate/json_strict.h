// JSON as the format drivers read it: no object may hold a key twice. JSON leaves duplicates to the
// reader and nlohmann keeps the last one, so a file could say two things and be read as one of them
// (a safetensors header naming a tensor twice, at two places): such a document is refused.
#pragma once

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "optstate/io.h"

namespace optstate {

// How deep arrays and objects may nest. What optstate reads nests a few levels (a native manifest:
// 8); nlohmann's parser and destructor keep their own stacks, but its dump() (the manifest
// checksum) and copies recurse once per level: a hostile 10 MB manifest of brackets overflowed the
// call stack there.
inline constexpr std::size_t kMaxJsonDepth = 100;

// What one value of the document costs at most, its slot and its container's share (a 256 MB
// manifest of `{},` took 9.2 GB: 105 bytes a value). The values are capped at parser_memory_budget
// (a quarter of the memory this process may use): a real manifest holds a value per 13 bytes or
// more, so even the largest one read (256 MB) stays under the cap of a 16 GB machine.
inline constexpr std::size_t kJsonBytesPerValue = 128;

namespace detail {

// The SAX handler behind parse_json_strict and parse_json_strict_members: builds the document
// itself, a key inserted into its object's map as it is read, the insertion saying whether the
// object held it already, so the duplicate check costs no lookup of its own. (nlohmann's callback
// parser, the other way to see keys, scans an object's parent at the end of each object:
// quadratic; a set of each object's keys beside nlohmann's DOM builder copied every key twice
// more.) With a stream path, the members of the object it names are handed to `on_member` as each
// completes instead of kept.
template <class OnMember>
struct StrictDom {
  using json = nlohmann::json;
  StrictDom(json& root, std::optional<std::string>& duplicate, std::string& refused, std::size_t values_left,
            const std::vector<std::string_view>* stream_path, OnMember& on_member)
      : root(root), duplicate(duplicate), refused(refused), values_left(values_left), stream_path(stream_path),
        on_member(on_member) {}
  json& root;
  std::optional<std::string>& duplicate;
  std::string& refused;
  std::size_t values_left;
  const std::vector<std::string_view>* stream_path;  // nullptr: keep everything
  OnMember& on_member;
  bool over_cap = false;
  std::vector<json*> open;   // the arrays and objects being filled, innermost last
  json* member = nullptr;    // the slot the last key made in the innermost object
  // The streamed object is open[stream_path->size()] while on_path exceeds that: on_path counts
  // the open objects, from the root, each the value of the stream path's next key in its parent.
  std::size_t on_path = 0;
  bool key_on_path = false;  // the last key continues the stream path
  std::string member_key;    // the streamed object's member being read
  json member_value;

  bool streaming_member_here() const {
    return stream_path && on_path == stream_path->size() + 1 && open.size() == on_path;
  }
  // Where the next value goes: the root, the end of the innermost array, or the object's slot;
  // nullptr (which stops the parse) past the cap on values.
  json* place(json&& v) {
    key_on_path = false;
    if (values_left == 0) return over_cap = true, nullptr;
    --values_left;
    if (open.empty()) {
      root = std::move(v);
      return &root;
    }
    json& top = *open.back();
    if (top.is_array()) return &top.get_ref<json::array_t&>().emplace_back(std::move(v));
    *member = std::move(v);
    return member;
  }
  bool deliver() {
    on_member(member_key, std::move(member_value));
    member_value = json();
    return true;
  }
  bool scalar(json&& v) {
    const bool streamed = streaming_member_here();
    if (!place(std::move(v))) return false;
    return streamed ? deliver() : true;
  }
  bool enter(json::value_t kind) {
    if (open.size() >= kMaxJsonDepth) {  // stops the parse: discarded
      refused = fmt::format("nested deeper than {} levels", kMaxJsonDepth);
      return false;
    }
    const bool continues_path = stream_path && kind == json::value_t::object && on_path == open.size() &&
                                on_path <= stream_path->size() && (open.empty() || key_on_path);
    json* slot = place(json(kind));
    if (!slot) return false;
    open.push_back(slot);
    if (continues_path) on_path = open.size();
    return true;
  }
  bool leave() {
    open.pop_back();
    if (on_path > open.size()) on_path = open.size();
    return streaming_member_here() ? deliver() : true;
  }
  bool null() { return scalar(json(nullptr)); }
  bool boolean(bool v) { return scalar(json(v)); }
  bool number_integer(json::number_integer_t v) { return scalar(json(v)); }
  bool number_unsigned(json::number_unsigned_t v) { return scalar(json(v)); }
  bool number_float(json::number_float_t v, const json::string_t&) { return scalar(json(v)); }
  bool string(json::string_t& v) { return scalar(json(std::move(v))); }
  bool binary(json::binary_t& v) { return scalar(json(json::binary_t(v))); }
  bool start_object(std::size_t) { return enter(json::value_t::object); }
  bool key(json::string_t& k) {
    if (streaming_member_here()) {  // not kept: on_member sees it with its value
      member_key = std::move(k);
      member = &member_value;
      return true;
    }
    key_on_path = stream_path && on_path == open.size() && open.size() <= stream_path->size() &&
                  k == (*stream_path)[open.size() - 1];
    auto [it, inserted] = open.back()->get_ref<json::object_t&>().try_emplace(k);
    if (!inserted && !duplicate) duplicate = k;
    member = &it->second;
    return true;
  }
  bool end_object() { return leave(); }
  bool start_array(std::size_t) { return enter(json::value_t::array); }
  bool end_array() { return leave(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) { return false; }
};

template <class OnMember>
nlohmann::json parse_json_strict_impl(const char* begin, const char* end, std::optional<std::string>& duplicate,
                                      std::string& refused, std::size_t max_values,
                                      const std::vector<std::string_view>* stream_path, OnMember& on_member) {
  using json = nlohmann::json;
  const bool by_machine = max_values == 0;
  if (by_machine) max_values = static_cast<std::size_t>(parser_memory_budget() / kJsonBytesPerValue);
  json root;
  refused.clear();
  StrictDom<OnMember> sax(root, duplicate, refused, max_values, stream_path, on_member);
  if (!json::sax_parse(begin, end, &sax)) {
    if (sax.over_cap)
      refused = fmt::format("of more than {} values, which would take more than {:.3g} GiB of memory{}", max_values,
                            static_cast<double>(max_values) * kJsonBytesPerValue / double(1 << 30),
                            by_machine ? " (a quarter of this machine's)" : "");
    return json(json::value_t::discarded);
  }
  return root;
}

}  // namespace detail

// Parses [begin, end) as one JSON document (discarded when it is not one, or when it nests deeper
// than kMaxJsonDepth or holds more values than `max_values`, 0: the memory cap above; then
// `refused` says which, e.g. "nested deeper than 100 levels"), setting `duplicate` to the first key
// that appears twice in one object.
inline nlohmann::json parse_json_strict(const char* begin, const char* end, std::optional<std::string>& duplicate,
                                        std::string& refused, std::size_t max_values = 0) {
  auto keep_all = [](std::string&, nlohmann::json&&) {};
  return detail::parse_json_strict_impl(begin, end, duplicate, refused, max_values, nullptr, keep_all);
}

// The same, except that the members of the object at `path` (keys from the root object; empty: the
// root object itself) are not kept: `on_member(std::string& key, json&& value)` is called with each
// as soon as its value is complete, in the order of the text, and that object stays empty in the
// document returned. For documents whose bulk is one object of many small members (a safetensors
// header's tensors, the optstate metadata's params): each member is a small document made and
// dropped, not one of a tree of hundreds of thousands built, searched by key and freed (at 200,000
// params the tree was two thirds of opening a safetensors file). The keys of that object are not
// checked for duplicates here: `on_member` sees every one, and keeps them. A document that ends in
// a syntax error may have delivered some members first.
template <class OnMember>
nlohmann::json parse_json_strict_members(const char* begin, const char* end, const std::vector<std::string_view>& path,
                                         OnMember&& on_member, std::optional<std::string>& duplicate,
                                         std::string& refused, std::size_t max_values = 0) {
  return detail::parse_json_strict_impl(begin, end, duplicate, refused, max_values, &path, on_member);
}

}  // namespace optstate
