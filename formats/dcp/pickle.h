// A small, safe pickle interpreter (protocols 2-5) for DCP's `.metadata` and torch.save's data.pkl.
// It never runs anything: GLOBAL/STACK_GLOBAL give inert Global values, REDUCE/NEWOBJ/BUILD give
// Object values recording the callable, its arguments and the state; the callers recognize the
// few classes they know (DCP metadata dataclasses, torch.Size, dtypes, tensor rebuilds, torchao's
// OptimState8bit) by name. Values live in one arena addressed by index, so cycles a hostile pickle
// builds through the memo cannot leak or recurse; nesting depth, value count and every declared
// length are capped and checked before anything is allocated.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string_view>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "optstate/status.h"

namespace optstate::pickle {

enum class Kind : uint8_t { kNone, kBool, kInt, kFloat, kStr, kBytes, kTuple, kList, kDict, kSet, kGlobal, kObject, kPersId };

using Ref = uint32_t;
inline constexpr Ref kNoRef = 0xffffffffu;

// A string a Pickle holds (its own copy, valid as long as the Pickle): read and compared as a
// std::string_view, converted to a std::string where one is needed. 16 bytes, no allocation of its
// own: a DCP .metadata of a large run holds tens of millions of values.
struct Text : std::string_view {
  constexpr Text() = default;
  constexpr Text(std::string_view v) : std::string_view(v) {}
  operator std::string() const { return std::string(data(), size()); }
};

struct Value {
  Kind kind = Kind::kNone;
  bool newobj = false;       // kObject: made by NEWOBJ (cls.__new__) rather than REDUCE (callable(*args))
  uint16_t depth = 1;        // nesting depth of the value (capped)
  Ref callable = kNoRef;     // kObject: the Global (or other value) called
  Ref args = kNoRef;         // kObject: the argument tuple
  Ref state = kNoRef;        // kObject: BUILD's argument
  Ref pid = kNoRef;          // kPersId: the persistent id
  int64_t i = 0;             // kBool, kInt
  double f = 0;              // kFloat
  Text s;                    // kStr, kBytes; kGlobal: module
  Text name;                 // kGlobal: qualified name
  std::vector<Ref> items;    // kTuple/kList/kSet: elements; kDict and dict-like objects: k0, v0, k1, v1, ...
};

// The values of a pickle: a deque, whose blocks never move as it grows (no copy of all of them)
// and stay small for the many small pickles (each DCP item's data.pkl).
using ValueArena = std::deque<Value>;

struct Limits {
  // Values beyond this are refused; no input makes more values than it has bytes (each is made by
  // an opcode), so the input's size caps them too. 2^28: the .metadata of a run on thousands of
  // GPUs (about 30 values a chunk, a chunk per rank per tensor) fits.
  uint32_t max_values = 1u << 28;
  uint16_t max_depth = 256;
};

class Pickle {
 public:
  Pickle() = default;
  Pickle(Pickle&&) = default;
  Pickle& operator=(Pickle&&) = default;

  // A value, or (a ref past the values, or an empty Pickle) a value of kind kNone.
  const Value& at(Ref r) const { return r < size() ? store_->values[r] : kNothing; }
  Ref root() const { return root_; }
  size_t size() const { return store_ ? store_->values.size() : 0; }

  // Conveniences for the interpretation layers: checked access that names what was expected.
  bool is_global(Ref r, std::string_view module, std::string_view name) const;
  // For a kDict or dict-like object: the value under string key `key`, or kNoRef.
  Ref dict_get(Ref r, std::string_view key) const;

 private:
  friend Result<Pickle> unpickle(std::span<const std::byte> bytes, const std::string& where, const Limits& limits);
  struct Store {
    ValueArena values;
    std::deque<std::string> texts;  // what the values' Text point into (a deque: never moved)
  };
  static const Value kNothing;
  std::unique_ptr<Store> store_;  // none until unpickled: an empty Pickle holds no memory
  Ref root_ = kNoRef;
};

// `where` names the file or item in errors ("... .metadata: pickle opcode 0x63 at byte 120: ...").
Result<Pickle> unpickle(std::span<const std::byte> bytes, const std::string& where, const Limits& limits = {});

// ---- writing (the DCP writer): a minimal protocol-2 encoder of the same value model ----
class Writer {
 public:
  Writer();
  void none();
  void boolean(bool v);
  void integer(int64_t v);
  void real(double v);
  void str(std::string_view v);
  void bytes(std::string_view v);
  void global(std::string_view module, std::string_view name);
  void mark();
  void tuple_from_mark();  // TUPLE
  void empty_tuple();
  void empty_list();
  void appends_from_mark();
  void empty_dict();
  void setitems_from_mark();
  void reduce();    // callable args REDUCE
  void newobj();    // cls args NEWOBJ
  void build();     // obj state BUILD
  void binpersid();
  std::string finish();  // STOP; the pickle bytes

 private:
  std::string out_;
};

// Writes value `r` of `p` again with `w` (what a writer carries from a file it read: DeepSpeed's
// optimizer settings, its loss scaler). Shared values are written once per use; a cycle, a
// persistent id (a tensor's storage, which is not carried), an object with appended items other
// than an OrderedDict's, a global whose name would break the pickle, or more than `max_values`
// values written are errors naming `where`.
Status emit(Writer& w, const Pickle& p, Ref r, const std::string& where, size_t max_values = size_t{1} << 20);

// The same, with `hook` asked first for every value: it writes a value of its own in place of value
// `r` (a tensor the writer replaces, a number it changes, a carried tensor's persistent id with the
// storage key it gets in the new file) and returns true, or returns false to have it written as read.
using EmitHook = std::function<Result<bool>(Writer& w, Ref r)>;
Status emit(Writer& w, const Pickle& p, Ref r, const std::string& where, const EmitHook& hook,
            size_t max_values = size_t{1} << 20);

}  // namespace optstate::pickle
