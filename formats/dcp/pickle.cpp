#include "pickle.h"

#include "optstate/io.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <new>
#include <stdexcept>
#include <cstring>
#include <unordered_map>

namespace optstate::pickle {
namespace {

class Machine {
 public:
  Machine(std::span<const std::byte> b, const std::string& where, const Limits& l, ValueArena& values,
          TextArena& texts)
      : b_(b), where_(where), limits_(l), values_(values), texts_(texts) {
    limits_.max_values = static_cast<uint32_t>(std::min<uint64_t>(limits_.max_values, b.size()));
    memory_by_machine_ = !limits_.max_memory;
    if (memory_by_machine_) limits_.max_memory = parser_memory_budget();
    memory_values_ = limits_.max_memory / kBytesPerValue;
  }

  Result<Ref> run() {
    while (true) {
      if (pos_ >= b_.size()) return fail("ends without STOP");
      op_at_ = pos_;
      op_ = u8();
      switch (op_) {
        case 0x80: {  // PROTO
          OPTSTATE_ASSIGN_OR_RETURN(uint64_t v, uint(1));
          if (v < 2 || v > 5) return fail(fmt::format("protocol {} (2..5 are read)", v));
          break;
        }
        case 0x95: OPTSTATE_RETURN_IF_ERROR(uint(8).status()); break;  // FRAME: frames are contiguous
        case '.': {  // STOP
          if (stack_.size() != 1 || !marks_.empty()) return fail("STOP with a stack that is not one value");
          return stack_.back();
        }
        case '(': marks_.push_back(stack_.size()); break;
        case '0': OPTSTATE_RETURN_IF_ERROR(pop().status()); break;
        case '1': {  // POP_MARK
          OPTSTATE_ASSIGN_OR_RETURN(size_t m, pop_mark());
          stack_.resize(m);
          break;
        }
        case '2': {  // DUP
          OPTSTATE_ASSIGN_OR_RETURN(Ref r, top());
          OPTSTATE_RETURN_IF_ERROR(push(r));
          break;
        }
        case 'N': OPTSTATE_RETURN_IF_ERROR(push_shared(none_, Kind::kNone)); break;
        case 0x88:
        case 0x89: {  // NEWTRUE, NEWFALSE
          OPTSTATE_ASSIGN_OR_RETURN(Ref r, make(Kind::kBool));
          values_[r].i = op_ == 0x88;
          OPTSTATE_RETURN_IF_ERROR(push(r));
          break;
        }
        case 'J': {  // BININT
          OPTSTATE_ASSIGN_OR_RETURN(uint64_t v, uint(4));
          OPTSTATE_RETURN_IF_ERROR(push_int(static_cast<int32_t>(static_cast<uint32_t>(v))));
          break;
        }
        case 'K':
        case 'M': {  // BININT1, BININT2
          OPTSTATE_ASSIGN_OR_RETURN(uint64_t v, uint(op_ == 'K' ? 1 : 2));
          OPTSTATE_RETURN_IF_ERROR(push_int(static_cast<int64_t>(v)));
          break;
        }
        case 0x8a:
        case 0x8b: {  // LONG1, LONG4: little-endian two's complement, at most 8 bytes here
          OPTSTATE_ASSIGN_OR_RETURN(uint64_t n, uint(op_ == 0x8a ? 1 : 4));
          if (n > 8) return fail(fmt::format("integer of {} bytes is too large", n));
          OPTSTATE_ASSIGN_OR_RETURN(auto raw, take(n));
          uint64_t v = 0;
          for (size_t k = 0; k < n; ++k) v |= static_cast<uint64_t>(static_cast<uint8_t>(raw[k])) << (8 * k);
          if (n > 0 && n < 8 && (static_cast<uint8_t>(raw[n - 1]) & 0x80)) v |= ~uint64_t{0} << (8 * n);
          OPTSTATE_RETURN_IF_ERROR(push_int(static_cast<int64_t>(v)));
          break;
        }
        case 'G': {  // BINFLOAT, big-endian double
          OPTSTATE_ASSIGN_OR_RETURN(auto raw, take(8));
          uint64_t bits = 0;
          for (size_t k = 0; k < 8; ++k) bits = bits << 8 | static_cast<uint8_t>(raw[k]);
          OPTSTATE_ASSIGN_OR_RETURN(Ref r, make(Kind::kFloat));
          std::memcpy(&values_[r].f, &bits, 8);
          OPTSTATE_RETURN_IF_ERROR(push(r));
          break;
        }
        case 0x8c: OPTSTATE_RETURN_IF_ERROR(push_string(Kind::kStr, 1)); break;  // SHORT_BINUNICODE
        case 'X': OPTSTATE_RETURN_IF_ERROR(push_string(Kind::kStr, 4)); break;   // BINUNICODE
        case 0x8d: OPTSTATE_RETURN_IF_ERROR(push_string(Kind::kStr, 8)); break;  // BINUNICODE8
        case 'U': OPTSTATE_RETURN_IF_ERROR(push_string(Kind::kStr, 1)); break;   // SHORT_BINSTRING
        case 'T': OPTSTATE_RETURN_IF_ERROR(push_string(Kind::kStr, 4)); break;   // BINSTRING
        case 'C': OPTSTATE_RETURN_IF_ERROR(push_string(Kind::kBytes, 1)); break;  // SHORT_BINBYTES
        case 'B': OPTSTATE_RETURN_IF_ERROR(push_string(Kind::kBytes, 4)); break;  // BINBYTES
        case 0x8e: OPTSTATE_RETURN_IF_ERROR(push_string(Kind::kBytes, 8)); break;  // BINBYTES8
        case 0x96: OPTSTATE_RETURN_IF_ERROR(push_string(Kind::kBytes, 8)); break;  // BYTEARRAY8
        case ')': OPTSTATE_RETURN_IF_ERROR(push_shared(empty_tuple_, Kind::kTuple)); break;
        case 't': OPTSTATE_RETURN_IF_ERROR(collect(Kind::kTuple)); break;
        case 0x85:
        case 0x86:
        case 0x87: {  // TUPLE1..3
          const size_t n = static_cast<size_t>(op_ - 0x84);
          if (stack_.size() < n + floor()) return fail("stack underflow");
          OPTSTATE_RETURN_IF_ERROR(push_container(Kind::kTuple, stack_.size() - n));
          break;
        }
        case ']': OPTSTATE_RETURN_IF_ERROR(push_new(Kind::kList)); break;
        case 'l': OPTSTATE_RETURN_IF_ERROR(collect(Kind::kList)); break;
        case '}': OPTSTATE_RETURN_IF_ERROR(push_new(Kind::kDict)); break;
        case 'd': {  // DICT
          OPTSTATE_ASSIGN_OR_RETURN(size_t m, pop_mark());
          if ((stack_.size() - m) % 2) return fail("DICT with an odd number of items");
          OPTSTATE_RETURN_IF_ERROR(push_container(Kind::kDict, m));
          break;
        }
        case 0x8f: OPTSTATE_RETURN_IF_ERROR(push_new(Kind::kSet)); break;  // EMPTY_SET
        case 0x91: OPTSTATE_RETURN_IF_ERROR(collect(Kind::kSet)); break;   // FROZENSET
        case 'a': {  // APPEND
          if (stack_.size() <= floor()) return fail("stack underflow");
          OPTSTATE_RETURN_IF_ERROR(extend(stack_.size() - 1, false));
          break;
        }
        case 'e':      // APPENDS
        case 0x90: {   // ADDITEMS
          OPTSTATE_ASSIGN_OR_RETURN(size_t m, pop_mark());
          OPTSTATE_RETURN_IF_ERROR(extend(m, false));
          break;
        }
        case 's': {  // SETITEM
          if (stack_.size() < floor() + 2) return fail("stack underflow");
          OPTSTATE_RETURN_IF_ERROR(extend(stack_.size() - 2, true));
          break;
        }
        case 'u': {  // SETITEMS
          OPTSTATE_ASSIGN_OR_RETURN(size_t m, pop_mark());
          if ((stack_.size() - m) % 2) return fail("SETITEMS with an odd number of items");
          OPTSTATE_RETURN_IF_ERROR(extend(m, true));
          break;
        }
        case 'c': {  // GLOBAL "module\nname\n"
          OPTSTATE_ASSIGN_OR_RETURN(std::string module, line());
          OPTSTATE_ASSIGN_OR_RETURN(std::string name, line());
          OPTSTATE_RETURN_IF_ERROR(push_global(std::move(module), std::move(name)));
          break;
        }
        case 0x93: {  // STACK_GLOBAL
          OPTSTATE_ASSIGN_OR_RETURN(Ref name, pop());
          OPTSTATE_ASSIGN_OR_RETURN(Ref module, pop());
          if (values_[name].kind != Kind::kStr || values_[module].kind != Kind::kStr)
            return fail("STACK_GLOBAL needs two strings");
          OPTSTATE_RETURN_IF_ERROR(push_global(values_[module].s, values_[name].s));
          break;
        }
        case 'R':      // REDUCE
        case 0x81: {   // NEWOBJ
          OPTSTATE_ASSIGN_OR_RETURN(Ref args, pop());
          OPTSTATE_ASSIGN_OR_RETURN(Ref callable, pop());
          if (values_[args].kind != Kind::kTuple) return fail("REDUCE/NEWOBJ arguments are not a tuple");
          OPTSTATE_RETURN_IF_ERROR(push_object(callable, args, op_ == 0x81));
          break;
        }
        case 0x92: {  // NEWOBJ_EX cls args kwargs
          OPTSTATE_ASSIGN_OR_RETURN(Ref kwargs, pop());
          OPTSTATE_ASSIGN_OR_RETURN(Ref args, pop());
          OPTSTATE_ASSIGN_OR_RETURN(Ref cls, pop());
          if (values_[args].kind != Kind::kTuple || values_[kwargs].kind != Kind::kDict)
            return fail("NEWOBJ_EX needs a tuple and a dict");
          OPTSTATE_RETURN_IF_ERROR(push_object(cls, args, true));
          break;
        }
        case 'b': {  // BUILD
          OPTSTATE_ASSIGN_OR_RETURN(Ref st, pop());
          OPTSTATE_ASSIGN_OR_RETURN(Ref obj, top());
          Value& o = values_[obj];
          if (o.kind != Kind::kObject) return fail("BUILD on a value that is not an object");
          if (o.state != kNoRef) return fail("BUILD twice on one object");
          o.state = st;
          o.depth = std::max<uint16_t>(o.depth, static_cast<uint16_t>(values_[st].depth + 1));
          OPTSTATE_RETURN_IF_ERROR(check_depth(o.depth));
          break;
        }
        case 'Q': {  // BINPERSID
          OPTSTATE_ASSIGN_OR_RETURN(Ref pid, pop());
          OPTSTATE_ASSIGN_OR_RETURN(Ref r, make(Kind::kPersId));
          values_[r].pid = pid;
          values_[r].depth = static_cast<uint16_t>(values_[pid].depth + 1);
          OPTSTATE_RETURN_IF_ERROR(check_depth(values_[r].depth));
          OPTSTATE_RETURN_IF_ERROR(push(r));
          break;
        }
        case 'q':
        case 'r': {  // BINPUT, LONG_BINPUT
          OPTSTATE_ASSIGN_OR_RETURN(uint64_t k, uint(op_ == 'q' ? 1 : 4));
          OPTSTATE_RETURN_IF_ERROR(memo_put(k));
          break;
        }
        case 0x94: OPTSTATE_RETURN_IF_ERROR(memo_put(memo_.size())); break;  // MEMOIZE
        case 'h':
        case 'j': {  // BINGET, LONG_BINGET
          OPTSTATE_ASSIGN_OR_RETURN(uint64_t k, uint(op_ == 'h' ? 1 : 4));
          OPTSTATE_RETURN_IF_ERROR(memo_get(k));
          break;
        }
        default: return fail("unsupported opcode");
      }
    }
  }

 private:
  Status fail(const std::string& what) const {
    return corrupt(fmt::format("{}: pickle opcode 0x{:02x} at byte {}: {}", where_, op_, op_at_, what));
  }
  uint8_t u8() { return static_cast<uint8_t>(b_[pos_++]); }
  Result<std::span<const std::byte>> take(uint64_t n) {
    if (n > b_.size() - pos_) return fail(fmt::format("declares {} bytes, {} remain", n, b_.size() - pos_));
    auto s = b_.subspan(pos_, static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return s;
  }
  Result<uint64_t> uint(int n) {
    OPTSTATE_ASSIGN_OR_RETURN(auto raw, take(static_cast<uint64_t>(n)));
    uint64_t v = 0;
    for (int k = n - 1; k >= 0; --k) v = v << 8 | static_cast<uint8_t>(raw[static_cast<size_t>(k)]);
    return v;
  }
  Result<std::string> line() {
    const size_t start = pos_;
    while (pos_ < b_.size() && pos_ - start < 4096 && b_[pos_] != std::byte{'\n'}) ++pos_;
    if (pos_ >= b_.size() || b_[pos_] != std::byte{'\n'}) return fail("unterminated GLOBAL name");
    std::string s(reinterpret_cast<const char*>(b_.data()) + start, pos_ - start);
    ++pos_;
    return s;
  }
  size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  Status check_depth(uint16_t d) const {
    if (d > limits_.max_depth) return fail(fmt::format("nesting deeper than {}", limits_.max_depth));
    return Status::Ok();
  }
  Result<Ref> make(Kind k) {
    if (values_.size() >= limits_.max_values) return fail(fmt::format("more than {} values", limits_.max_values));
    if (values_.size() >= memory_values_)
      return fail(fmt::format("more than {} values, which would take more than {:.3g} GiB of memory{}", memory_values_,
                              static_cast<double>(limits_.max_memory) / double(1 << 30),
                              memory_by_machine_ ? " (a quarter of this machine's)" : ""));
    values_.emplace_back();
    values_.back().kind = k;
    return static_cast<Ref>(values_.size() - 1);
  }
  Status push(Ref r) {
    if (stack_.size() >= limits_.max_values) return fail("stack too deep");
    stack_.push_back(r);
    return Status::Ok();
  }
  Status push_new(Kind k) {
    OPTSTATE_ASSIGN_OR_RETURN(Ref r, make(k));
    return push(r);
  }
  // Limits::share_immutables: None, (), and small ints made once (only lists, dicts, sets and
  // objects take items or a state once made).
  Status push_shared(Ref& shared, Kind k) {
    if (!limits_.share_immutables) return push_new(k);
    if (shared == kNoRef) {
      OPTSTATE_ASSIGN_OR_RETURN(shared, make(k));
    }
    return push(shared);
  }
  Status push_int(int64_t v) {
    constexpr int64_t kShared = int64_t{1} << 16;
    const bool shared = limits_.share_immutables && v > -kShared && v < kShared;
    if (shared)
      if (auto it = small_ints_.find(v); it != small_ints_.end()) return push(it->second);
    OPTSTATE_ASSIGN_OR_RETURN(Ref r, make(Kind::kInt));
    values_[r].i = v;
    if (shared) small_ints_.emplace(v, r);
    return push(r);
  }
  Status push_string(Kind k, int len_bytes) {
    OPTSTATE_ASSIGN_OR_RETURN(uint64_t n, uint(len_bytes));
    OPTSTATE_ASSIGN_OR_RETURN(auto raw, take(n));  // checked against what remains before allocating
    OPTSTATE_ASSIGN_OR_RETURN(Ref r, make(k));
    values_[r].s = texts_.keep(std::string_view(reinterpret_cast<const char*>(raw.data()), raw.size()));
    return push(r);
  }
  Status push_global(std::string_view module, std::string_view name) {
    OPTSTATE_ASSIGN_OR_RETURN(Ref r, make(Kind::kGlobal));
    // One text "<module>\0<name>": name() finds the name after the module.
    const Text kept = texts_.keep_joined(module, name);
    values_[r].s = Text(std::string_view(kept.data(), module.size()));
    values_[r].i = static_cast<int64_t>(name.size());
    return push(r);
  }
  uint16_t depth_of(std::span<const Ref> items) const {
    uint16_t d = 0;
    for (Ref x : items) d = std::max(d, values_[x].depth);
    return static_cast<uint16_t>(d + 1);
  }
  // The stack's values from `from` up (above the floor) as a new container, in their place.
  Status push_container(Kind k, size_t from) {
    const std::span<const Ref> items(stack_.data() + from, stack_.size() - from);
    const uint16_t d = depth_of(items);
    OPTSTATE_RETURN_IF_ERROR(check_depth(d));
    OPTSTATE_ASSIGN_OR_RETURN(Ref r, make(k));
    values_[r].items = Refs(items);
    values_[r].depth = d;
    stack_.resize(from);
    return push(r);
  }
  Status collect(Kind k) {
    OPTSTATE_ASSIGN_OR_RETURN(size_t m, pop_mark());
    return push_container(k, m);
  }
  Status push_object(Ref callable, Ref args, bool newobj) {
    const uint16_t d = static_cast<uint16_t>(std::max(values_[callable].depth, values_[args].depth) + 1);
    OPTSTATE_RETURN_IF_ERROR(check_depth(d));
    OPTSTATE_ASSIGN_OR_RETURN(Ref r, make(Kind::kObject));
    values_[r].callable = callable;
    values_[r].args = args;
    values_[r].newobj = newobj;
    values_[r].depth = d;
    return push(r);
  }
  // APPEND(S)/SETITEM(S)/ADDITEMS of the stack's values from `from` up onto the value below them:
  // lists, dicts, sets, and objects that are dict- or list-like (OrderedDict, ...), recorded in
  // their items. The values leave the stack.
  Status extend(size_t from, bool pairs) {
    if (from <= floor()) return fail("stack underflow");
    const std::span<const Ref> items(stack_.data() + from, stack_.size() - from);
    const Ref target = stack_[from - 1];
    Value& t = values_[target];
    const bool ok = pairs ? (t.kind == Kind::kDict || t.kind == Kind::kObject)
                          : (t.kind == Kind::kList || t.kind == Kind::kSet || t.kind == Kind::kObject);
    if (!ok) return fail("items added to a value that cannot hold them");
    if (t.items.size() + items.size() > limits_.max_values) return fail("container too large");
    if (pairs) OPTSTATE_RETURN_IF_ERROR(check_new_keys(target, items));
    const uint16_t d = std::max(t.depth, depth_of(items));
    OPTSTATE_RETURN_IF_ERROR(check_depth(d));
    t.depth = d;
    t.items.append(items);
    stack_.resize(from);
    return Status::Ok();
  }
  // Python keeps one value per dict key, the last set; pickle.dumps never writes a key twice. A
  // str or int key set twice in one dict (a handmade pickle showing readers that take the first
  // another value than Python sees) is refused.
  Status check_new_keys(Ref target, std::span<const Ref> items) {
    auto keyed = [&](const Value& v) { return v.kind == Kind::kStr || v.kind == Kind::kInt || v.kind == Kind::kBool; };
    auto same = [](const Value& a, const Value& b) {
      return a.kind == Kind::kStr ? b.kind == Kind::kStr && a.s == b.s
                                  : (b.kind == Kind::kInt || b.kind == Kind::kBool) && a.i == b.i;
    };
    auto twice = [&](const Value& key) {
      return fail(key.kind == Kind::kStr ? fmt::format("a dict sets key '{}' twice", key.s.substr(0, 80))
                                         : fmt::format("a dict sets key {} twice", key.i));
    };
    const std::span<const Ref> had = values_[target].items;  // k0, v0, k1, v1, ...: the keys set so far
    // A small dict (a dataclass's state: most of a DCP .metadata's hundreds of thousands) is checked
    // by a scan, with no allocation; a larger one keeps a hash of its keys from then on.
    constexpr size_t kScanKeys = 16;
    if (had.size() / 2 + items.size() / 2 <= kScanKeys && !dict_keys_.count(target)) {
      for (size_t k = 0; k < items.size(); k += 2) {
        const Value& key = values_[items[k]];
        if (!keyed(key)) continue;  // other keys: not looked up
        for (size_t j = 0; j < had.size(); j += 2)
          if (same(key, values_[had[j]])) return twice(key);
        for (size_t j = 0; j < k; j += 2)
          if (same(key, values_[items[j]])) return twice(key);
      }
      return Status::Ok();
    }
    auto hash = [](const Value& v) {
      return v.kind == Kind::kStr ? std::hash<std::string_view>{}(v.s) : std::hash<int64_t>{}(v.i) ^ 0x9e3779b97f4a7c15ull;
    };
    auto [at, fresh] = dict_keys_.try_emplace(target);
    auto& seen = at->second;
    if (fresh)  // the keys it took while small
      for (size_t j = 0; j < had.size(); j += 2)
        if (keyed(values_[had[j]])) seen.emplace(hash(values_[had[j]]), had[j]);
    for (size_t k = 0; k < items.size(); k += 2) {
      const Value& key = values_[items[k]];
      if (!keyed(key)) continue;
      const uint64_t h = hash(key);
      const auto [lo, hi] = seen.equal_range(h);
      for (auto it = lo; it != hi; ++it)
        if (same(key, values_[it->second])) return twice(key);
      seen.emplace(h, items[k]);
    }
    return Status::Ok();
  }
  Result<Ref> pop() {
    if (stack_.size() <= floor()) return fail("stack underflow");
    Ref r = stack_.back();
    stack_.pop_back();
    return r;
  }
  Result<Ref> top() const {
    if (stack_.size() <= floor()) return fail("stack underflow");
    return stack_.back();
  }
  Result<size_t> pop_mark() {
    if (marks_.empty()) return fail("no MARK");
    size_t m = marks_.back();
    marks_.pop_back();
    return m;
  }
  Status memo_put(uint64_t key) {
    OPTSTATE_ASSIGN_OR_RETURN(Ref r, top());
    if (key > limits_.max_values) return fail("memo key out of range");
    if (key >= memo_.size()) memo_.resize(static_cast<size_t>(key) + 1, kNoRef);
    memo_[static_cast<size_t>(key)] = r;
    return Status::Ok();
  }
  Status memo_get(uint64_t key) {
    if (key >= memo_.size() || memo_[static_cast<size_t>(key)] == kNoRef) return fail(fmt::format("memo {} unset", key));
    return push(memo_[static_cast<size_t>(key)]);
  }

  std::span<const std::byte> b_;
  const std::string& where_;
  Limits limits_;
  // A value and its place on the stack: what each opcode that makes one costs at most.
  static constexpr uint64_t kBytesPerValue = sizeof(Value) + sizeof(Ref);
  uint64_t memory_values_ = 0;
  bool memory_by_machine_ = false;
  ValueArena& values_;
  TextArena& texts_;
  std::vector<Ref> stack_;
  std::unordered_map<Ref, std::unordered_multimap<uint64_t, Ref>> dict_keys_;  // check_new_keys
  std::vector<size_t> marks_;
  std::vector<Ref> memo_;
  Ref none_ = kNoRef, empty_tuple_ = kNoRef;   // push_shared
  std::unordered_map<int64_t, Ref> small_ints_;  // push_int
  size_t pos_ = 0, op_at_ = 0;
  uint8_t op_ = 0;
};

}  // namespace

const Value Pickle::kNothing{};

const Ref& Refs::at(size_t i) const {
  if (i >= size_) throw std::out_of_range(fmt::format("pickle::Refs::at: {} >= size {}", i, size_));
  return data()[i];
}

void Refs::append(std::span<const Ref> more) {
  // Callers cap a container's items far below 2^32 (Limits::max_values).
  const size_t need = size_ + more.size();
  if (need > cap_) {
    uint32_t cap = cap_;
    while (cap < need) cap = cap * 2;
    Ref* grown = new Ref[cap];
    std::copy(data(), data() + size_, grown);
    if (on_heap()) delete[] heap_;
    heap_ = grown;
    cap_ = cap;
  }
  std::copy(more.begin(), more.end(), (on_heap() ? heap_ : in_) + size_);
  size_ = static_cast<uint32_t>(need);
}

ValueArena::~ValueArena() {
  for (size_t i = 0; i < size_; ++i) slot(i)->~Value();
  for (Value* block : blocks_) ::operator delete(block);
}

Value& ValueArena::emplace_back() {
  if (size_ == capacity_) {  // a new block, of the size slot() maps the next values to
    const size_t n = block_size(blocks_.size());
    // (Value's alignment is within operator new's.)
    static_assert(alignof(Value) <= __STDCPP_DEFAULT_NEW_ALIGNMENT__);
    blocks_.push_back(static_cast<Value*>(::operator new(n * sizeof(Value))));
    capacity_ += n;
  }
  Value* v = new (slot(size_)) Value();
  ++size_;
  return *v;
}

char* TextArena::place(size_t n) {
  if (n > room_) {
    // A new block: twice the last (to 1 MiB), or the text's own size where larger.
    const size_t block = std::max(next_, n);
    next_ = std::min<size_t>(next_ * 2, size_t{1} << 20);
    blocks_.push_back(std::unique_ptr<char[]>(new char[block]));
    used_ = 0;
    room_ = block;
  }
  char* at = blocks_.back().get() + used_;
  used_ += n;
  room_ -= n;
  return at;
}

Text TextArena::keep(std::string_view s) {
  if (s.empty()) return Text();
  char* at = place(s.size());
  std::memcpy(at, s.data(), s.size());
  return Text(std::string_view(at, s.size()));
}

Text TextArena::keep_joined(std::string_view a, std::string_view b) {
  const size_t n = a.size() + 1 + b.size();
  char* at = place(n);  // (a and b may lie in earlier blocks, which stay where they are)
  if (!a.empty()) std::memcpy(at, a.data(), a.size());
  at[a.size()] = '\0';
  if (!b.empty()) std::memcpy(at + a.size() + 1, b.data(), b.size());
  return Text(std::string_view(at, n));
}

bool Pickle::is_global(Ref r, std::string_view module, std::string_view name) const {
  if (r == kNoRef || r >= size()) return false;
  const Value& v = at(r);
  return v.kind == Kind::kGlobal && v.s == module && v.name() == name;
}

Ref Pickle::dict_get(Ref r, std::string_view key) const {
  if (r == kNoRef || r >= size()) return kNoRef;
  const Value& d = at(r);
  if (d.kind != Kind::kDict && d.kind != Kind::kObject) return kNoRef;
  for (size_t k = 0; k + 1 < d.items.size(); k += 2) {
    const Value& kv = at(d.items[k]);
    if (kv.kind == Kind::kStr && kv.s == key) return d.items[k + 1];
  }
  return kNoRef;
}

Result<Pickle> unpickle(std::span<const std::byte> bytes, const std::string& where, const Limits& limits) {
  Pickle p;
  p.store_ = std::make_unique<Pickle::Store>();
  Machine m(bytes, where, limits, p.store_->values, p.store_->texts);
  OPTSTATE_ASSIGN_OR_RETURN(p.root_, m.run());
  return p;
}

// ---- Writer ----

Writer::Writer() { out_ = std::string("\x80\x02", 2); }

namespace {
void put_le(std::string& out, uint64_t v, int n) {
  for (int k = 0; k < n; ++k) out.push_back(static_cast<char>((v >> (8 * k)) & 0xff));
}
}  // namespace

void Writer::none() { out_.push_back('N'); }
void Writer::boolean(bool v) { out_.push_back(static_cast<char>(v ? 0x88 : 0x89)); }
void Writer::integer(int64_t v) {
  if (v >= 0 && v < 256) {
    out_.push_back('K');
    put_le(out_, static_cast<uint64_t>(v), 1);
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    out_.push_back('J');
    put_le(out_, static_cast<uint64_t>(static_cast<uint32_t>(static_cast<int32_t>(v))), 4);
  } else {
    out_.push_back(static_cast<char>(0x8a));
    out_.push_back(8);
    put_le(out_, static_cast<uint64_t>(v), 8);
  }
}
void Writer::real(double v) {
  out_.push_back('G');
  uint64_t bits;
  std::memcpy(&bits, &v, 8);
  for (int k = 7; k >= 0; --k) out_.push_back(static_cast<char>((bits >> (8 * k)) & 0xff));
}
bool Writer::recall(const Memo& memo, std::string_view key) {
  const auto it = memo.find(key);
  if (it == memo.end()) return false;
  if (it->second < 256) {
    out_.push_back('h');  // BINGET
    put_le(out_, it->second, 1);
  } else {
    out_.push_back('j');  // LONG_BINGET
    put_le(out_, it->second, 4);
  }
  return true;
}
void Writer::remember(Memo& memo, std::string_view key) {
  const uint32_t index = memo_size_++;
  if (index < 256) {
    out_.push_back('q');  // BINPUT
    put_le(out_, index, 1);
  } else {
    out_.push_back('r');  // LONG_BINPUT
    put_le(out_, index, 4);
  }
  memo.emplace(std::string(key), index);
}
void Writer::str(std::string_view v) {
  if (recall(strings_, v)) return;
  out_.push_back('X');
  put_le(out_, v.size(), 4);
  out_.append(v);
  remember(strings_, v);
}
void Writer::bytes(std::string_view v) {
  out_.push_back('B');
  put_le(out_, v.size(), 4);
  out_.append(v);
}
void Writer::global(std::string_view module, std::string_view name) {
  std::string key;  // the GLOBAL's text: "module\nname"
  key.reserve(module.size() + name.size() + 1);
  key.append(module);
  key.push_back('\n');
  key.append(name);
  if (recall(globals_, key)) return;
  out_.push_back('c');
  out_.append(key);
  out_.push_back('\n');
  remember(globals_, key);
}
void Writer::mark() { out_.push_back('('); }
void Writer::tuple_from_mark() { out_.push_back('t'); }
void Writer::empty_tuple() { out_.push_back(')'); }
void Writer::empty_list() { out_.push_back(']'); }
void Writer::appends_from_mark() { out_.push_back('e'); }
void Writer::empty_dict() { out_.push_back('}'); }
void Writer::setitems_from_mark() { out_.push_back('u'); }
void Writer::reduce() { out_.push_back('R'); }
void Writer::newobj() { out_.push_back(static_cast<char>(0x81)); }
void Writer::build() { out_.push_back('b'); }
void Writer::binpersid() { out_.push_back('Q'); }
std::string Writer::finish() {
  out_.push_back('.');
  return std::move(out_);
}

namespace {

struct Emitter {
  Writer& w;
  const Pickle& p;
  const std::string& where;
  size_t budget;
  std::vector<bool> open;  // values being written: reaching one again is a cycle
  const EmitHook* hook = nullptr;

  Status pairs(std::span<const Ref> items) {
    if (items.size() % 2) return corrupt(where + ": a mapping with an odd number of items");
    if (items.empty()) return Status::Ok();
    w.mark();
    for (Ref x : items) OPTSTATE_RETURN_IF_ERROR(value(x));
    w.setitems_from_mark();
    return Status::Ok();
  }
  Status sequence(std::span<const Ref> items) {
    for (Ref x : items) OPTSTATE_RETURN_IF_ERROR(value(x));
    return Status::Ok();
  }
  Status value(Ref r) {
    if (r >= p.size()) return corrupt(where + ": a reference out of range");
    if (budget-- == 0) return corrupt(where + ": too many values to write again");
    if (open[r]) return corrupt(where + ": a value that contains itself");
    if (hook && *hook) {
      OPTSTATE_ASSIGN_OR_RETURN(const bool written, (*hook)(w, r));
      if (written) return Status::Ok();
    }
    open[r] = true;
    const Value& v = p.at(r);
    switch (v.kind) {
      case Kind::kNone: w.none(); break;
      case Kind::kBool: w.boolean(v.i != 0); break;
      case Kind::kInt: w.integer(v.i); break;
      case Kind::kFloat: w.real(v.f); break;
      case Kind::kStr: w.str(v.s); break;
      case Kind::kBytes: w.bytes(v.s); break;
      case Kind::kTuple:
        w.mark();
        OPTSTATE_RETURN_IF_ERROR(sequence(v.items));
        w.tuple_from_mark();
        break;
      case Kind::kList:
        w.empty_list();
        if (!v.items.empty()) {
          w.mark();
          OPTSTATE_RETURN_IF_ERROR(sequence(v.items));
          w.appends_from_mark();
        }
        break;
      case Kind::kSet:  // set([...]): protocol 2 has no set opcodes
        w.global("builtins", "set");
        w.mark();
        w.empty_list();
        if (!v.items.empty()) {
          w.mark();
          OPTSTATE_RETURN_IF_ERROR(sequence(v.items));
          w.appends_from_mark();
        }
        w.tuple_from_mark();
        w.reduce();
        break;
      case Kind::kDict:
        w.empty_dict();
        OPTSTATE_RETURN_IF_ERROR(pairs(v.items));
        break;
      case Kind::kGlobal:
        if (v.s.find('\n') != std::string::npos || v.name().find('\n') != std::string::npos || v.s.empty() ||
            v.name().empty())
          return corrupt(where + ": a global with an unusable name");
        w.global(v.s, v.name());
        break;
      case Kind::kObject: {
        if (v.callable == kNoRef || v.args == kNoRef) return corrupt(where + ": an object without its constructor");
        OPTSTATE_RETURN_IF_ERROR(value(v.callable));
        OPTSTATE_RETURN_IF_ERROR(value(v.args));
        if (v.newobj) w.newobj();
        else w.reduce();
        if (!v.items.empty()) {
          if (!p.is_global(v.callable, "collections", "OrderedDict"))
            return corrupt(where + ": an object with appended items (only an OrderedDict's are written again)");
          OPTSTATE_RETURN_IF_ERROR(pairs(v.items));
        }
        if (v.state != kNoRef) {
          OPTSTATE_RETURN_IF_ERROR(value(v.state));
          w.build();
        }
        break;
      }
      case Kind::kPersId:
        return corrupt(where + ": a tensor (persistent id) where settings were expected");
    }
    open[r] = false;
    return Status::Ok();
  }
};

}  // namespace

Status emit(Writer& w, const Pickle& p, Ref r, const std::string& where, size_t max_values) {
  Emitter e{w, p, where, max_values, std::vector<bool>(p.size(), false)};
  return e.value(r);
}

Status emit(Writer& w, const Pickle& p, Ref r, const std::string& where, const EmitHook& hook, size_t max_values) {
  Emitter e{w, p, where, max_values, std::vector<bool>(p.size(), false), &hook};
  return e.value(r);
}

}  // namespace optstate::pickle
