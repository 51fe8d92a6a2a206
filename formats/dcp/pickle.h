// A small, safe pickle interpreter (protocols 2-5) for DCP's `.metadata` and torch.save's data.pkl.
// It never runs anything: GLOBAL/STACK_GLOBAL give inert Global values, REDUCE/NEWOBJ/BUILD give
// Object values recording the callable, its arguments and the state; the callers recognize the
// few classes they know (DCP metadata dataclasses, torch.Size, dtypes, tensor rebuilds, torchao's
// OptimState8bit) by name. Values live in one arena addressed by index, so cycles a hostile pickle
// builds through the memo cannot leak or recurse; nesting depth, value count and every declared
// length are capped and checked before anything is allocated.
#pragma once

#include <bit>
#include <cstdint>
#include <memory>
#include <string_view>
#include <functional>
#include <span>
#include <string>
#include <unordered_map>
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

// A value's items: up to four held in place (most of a DCP .metadata's tuples, sizes and small
// dataclass states), more on the heap. Read as a contiguous array of refs. 24 bytes.
class Refs {
 public:
  Refs() {}
  explicit Refs(std::span<const Ref> r) { append(r); }
  Refs(const Refs& o) { append(o); }
  Refs(Refs&& o) noexcept { take(o); }
  Refs& operator=(const Refs& o) {
    if (this != &o) {
      clear();
      append(o);
    }
    return *this;
  }
  Refs& operator=(Refs&& o) noexcept {
    if (this != &o) {
      release();
      take(o);
    }
    return *this;
  }
  ~Refs() { release(); }

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const Ref* data() const { return on_heap() ? heap_ : in_; }
  const Ref* begin() const { return data(); }
  const Ref* end() const { return data() + size_; }
  const Ref& operator[](size_t i) const { return data()[i]; }
  const Ref& at(size_t i) const;  // checked: std::out_of_range past the end, as std::vector's
  const Ref& back() const { return data()[size_ - 1]; }
  operator std::span<const Ref>() const { return {data(), size_}; }
  void append(std::span<const Ref> more);
  void clear() { size_ = 0; }

 private:
  static constexpr uint32_t kInline = 4;
  bool on_heap() const { return cap_ > kInline; }
  void release() {
    if (on_heap()) delete[] heap_;
    size_ = 0;
    cap_ = kInline;
  }
  void take(Refs& o) {
    size_ = o.size_;
    cap_ = o.cap_;
    if (o.on_heap()) {
      heap_ = o.heap_;
    } else {
      for (uint32_t k = 0; k < size_; ++k) in_[k] = o.in_[k];
    }
    o.size_ = 0;
    o.cap_ = kInline;
  }
  uint32_t size_ = 0, cap_ = kInline;
  union {
    Ref in_[kInline];
    Ref* heap_;
  };
};

struct Value {
  Kind kind = Kind::kNone;
  bool newobj = false;       // kObject: made by NEWOBJ (cls.__new__) rather than REDUCE (callable(*args))
  uint16_t depth = 1;        // nesting depth of the value (capped)
  Ref callable = kNoRef;     // kObject: the Global (or other value) called
  Ref args = kNoRef;         // kObject: the argument tuple
  Ref state = kNoRef;        // kObject: BUILD's argument
  Ref pid = kNoRef;          // kPersId: the persistent id
  int64_t i = 0;             // kBool, kInt; kGlobal: the length of name()
  double f = 0;              // kFloat
  Text s;                    // kStr, kBytes; kGlobal: module
  Refs items;                // kTuple/kList/kSet: elements; kDict and dict-like objects: k0, v0, k1, v1, ...

  // kGlobal: the qualified name, kept in the pickle's texts right after the module's (one byte
  // apart): a second Text in every value would be a sixth of a large DCP .metadata's memory.
  Text name() const {
    return kind == Kind::kGlobal && s.data() ? Text(std::string_view(s.data() + s.size() + 1, static_cast<size_t>(i)))
                                             : Text();
  }
};
static_assert(sizeof(Value) <= 80, "a DCP .metadata of a large run holds tens of millions of values");

// The values of a pickle, by index: blocks that double in size (32 values, 64, ... up to 2^20,
// then 2^20 each), never moved as it grows, values made in place only as they are added. A
// pickle of millions of values takes few allocations, a small one (each DCP item's data.pkl) one.
class ValueArena {
 public:
  ValueArena() = default;
  ValueArena(const ValueArena&) = delete;
  ValueArena& operator=(const ValueArena&) = delete;
  ~ValueArena();
  size_t size() const { return size_; }
  Value& operator[](size_t i) { return *slot(i); }
  const Value& operator[](size_t i) const { return *const_cast<ValueArena*>(this)->slot(i); }
  Value& emplace_back();
  Value& back() { return (*this)[size_ - 1]; }

 private:
  static constexpr unsigned kFirstBits = 5, kLastBits = 20;
  static constexpr size_t kGrowing = (size_t{1} << (kLastBits + 1)) - (size_t{1} << kFirstBits);  // in blocks 0..15
  static size_t block_size(size_t b) {
    return b <= kLastBits - kFirstBits ? size_t{1} << (b + kFirstBits) : size_t{1} << kLastBits;
  }
  // Inline: every value read goes through it (a DCP .metadata of a large run reads millions).
  Value* slot(size_t i) {
    if (i < kGrowing) {
      const size_t j = i + (size_t{1} << kFirstBits);
      const size_t b = static_cast<size_t>(std::bit_width(j)) - 1 - kFirstBits;
      return blocks_[b] + (j - (size_t{1} << (b + kFirstBits)));
    }
    const size_t k = i - kGrowing;
    return blocks_[kLastBits - kFirstBits + 1 + (k >> kLastBits)] + (k & ((size_t{1} << kLastBits) - 1));
  }
  std::vector<Value*> blocks_;
  size_t size_ = 0, capacity_ = 0;
};

// The strings a pickle holds, copied into blocks that are never moved (the Text values point into
// them): a few allocations for millions of keys and names, not one each.
class TextArena {
 public:
  TextArena() = default;
  TextArena(const TextArena&) = delete;
  TextArena& operator=(const TextArena&) = delete;
  Text keep(std::string_view s);
  // `a`, a NUL, then `b`, in one place (a Global's module and name): the text of all three.
  Text keep_joined(std::string_view a, std::string_view b);

 private:
  char* place(size_t n);  // n > 0 bytes, in the last block or a new one
  std::vector<std::unique_ptr<char[]>> blocks_;
  size_t used_ = 0, room_ = 0, next_ = 256;
};

struct Limits {
  // Values beyond this are refused; no input makes more values than it has bytes (each is made by
  // an opcode), so the input's size caps them too. 2^28: the .metadata of a run on thousands of
  // GPUs (about 30 values a chunk, a chunk per rank per tensor) fits.
  uint32_t max_values = 1u << 28;
  uint16_t max_depth = 256;
  // The values' memory: a pickle that would need more is refused before the machine runs out (a
  // few hundred MB of EMPTY_LIST opcodes make tens of GB of values). 0: parser_memory_budget (a
  // quarter of the memory this process may use). A real DCP .metadata takes about 10 times its
  // size, a torch.save data.pkl less.
  uint64_t max_memory = 0;
  // None, () and ints of magnitude below 2^16 made once and shared, as Python shares them: a third
  // fewer values in a DCP .metadata (each chunk's offsets, sizes and indices). Nothing changes them
  // once made; but a caller that tells values apart by Ref (emit's hooks replace one value, say a
  // world size, by its Ref) must not share them: off unless asked for.
  bool share_immutables = false;
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
    TextArena texts;  // what the values' Text point into
  };
  static const Value kNothing;
  std::unique_ptr<Store> store_;  // none until unpickled: an empty Pickle holds no memory
  Ref root_ = kNoRef;
};

// `where` names the file or item in errors ("... .metadata: pickle opcode 0x63 at byte 120: ...").
Result<Pickle> unpickle(std::span<const std::byte> bytes, const std::string& where, const Limits& limits = {});

// ---- writing (the DCP writer): a minimal protocol-2 encoder of the same value model ----
// Globals and strings are memoized as Python's pickler does (the first use BINPUT, each later one
// BINGET): both are immutable, and a DCP `.metadata` names the same few classes and field names
// for every item (without the memo it was 5x the size of torch's own for the same state).
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
  // Looked up by view (C++20 heterogeneous lookup): a name used again costs no allocation.
  struct ViewHash {
    using is_transparent = void;
    size_t operator()(std::string_view v) const { return std::hash<std::string_view>{}(v); }
  };
  using Memo = std::unordered_map<std::string, uint32_t, ViewHash, std::equal_to<>>;
  // Pushes `key`'s memo entry if `memo` has one; otherwise the caller writes the value and
  // remember() stores it under `key`.
  bool recall(const Memo& memo, std::string_view key);
  void remember(Memo& memo, std::string_view key);

  std::string out_;
  uint32_t memo_size_ = 0;  // memo ids given, in order (LibTorch's unpickler requires them sequential)
  Memo strings_, globals_;  // a string's text; a global's module + '\n' + name
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
