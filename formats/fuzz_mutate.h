// The byte mutations of the bounded fuzz runs every format's fuzz target makes in CTest (fuzz.*):
// 1-4 per input of bit flips, characters from `alphabet` (a random byte when it is empty), cuts,
// splices of the input into itself and truncation.
#pragma once

#include <random>
#include <string>
#include <string_view>

namespace optstate::fuzz {

inline void mutate(std::string& s, std::mt19937_64& rng, std::string_view alphabet) {
  const int edits = 1 + static_cast<int>(rng() % 4);
  for (int e = 0; e < edits && !s.empty(); ++e) {
    const size_t at = rng() % s.size();
    switch (rng() % 5) {
      case 0: s[at] = static_cast<char>(s[at] ^ (1 << (rng() % 8))); break;
      case 1: s[at] = alphabet.empty() ? static_cast<char>(rng()) : alphabet[rng() % alphabet.size()]; break;
      case 2: s.erase(at, rng() % 16); break;
      case 3: s.insert(at, s.substr(rng() % s.size(), rng() % 32)); break;
      case 4: s.resize(at); break;
    }
  }
}

inline constexpr std::string_view kJsonAlphabet = "0123456789-.e\"{}[],:";

}  // namespace optstate::fuzz
