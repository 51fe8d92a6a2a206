// JSON as the format drivers read it: no object may hold a key twice. JSON leaves duplicates to the
// reader and nlohmann keeps the last one, so a file could say two things and be read as one of them
// (a safetensors header naming a tensor twice, at two places): such a document is refused.
#pragma once

#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

namespace optstate {

// Parses [begin, end) as one JSON document (discarded when it is not one), setting `duplicate` to
// the first key that appears twice in one object.
inline nlohmann::json parse_json_strict(const char* begin, const char* end, std::optional<std::string>& duplicate) {
  using json = nlohmann::json;
  std::vector<std::unordered_set<std::string>> open_objects;
  auto seen = [&](int /*depth*/, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) {
      open_objects.emplace_back();
    } else if (event == json::parse_event_t::object_end) {
      if (!open_objects.empty()) open_objects.pop_back();
    } else if (event == json::parse_event_t::key && !duplicate && !open_objects.empty()) {
      std::string key = parsed.get<std::string>();
      if (!open_objects.back().insert(key).second) duplicate = std::move(key);
    }
    return true;
  };
  return json::parse(begin, end, seen, /*allow_exceptions=*/false);
}

}  // namespace optstate
