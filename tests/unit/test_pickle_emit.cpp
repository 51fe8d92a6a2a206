// The pickle interpreter's re-emitter (formats/dcp/pickle.h `emit`): what a writer carries from a
// file it read (DeepSpeed's optimizer settings, its loss scaler object, an enum) is written again
// as the same values; cycles, tensors and runaway sharing are refused.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <utility>
#include <vector>
#include <functional>
#include <span>
#include <string>

#include "dcp/pickle.h"

using namespace optstate;
using namespace optstate::pickle;

namespace {

Result<Pickle> parse(const std::string& bytes) { return unpickle(std::as_bytes(std::span(bytes)), "test"); }

// Structural equality of two values of two pickles.
bool same(const Pickle& a, Ref x, const Pickle& b, Ref y) {
  if ((x == kNoRef) != (y == kNoRef)) return false;
  if (x == kNoRef) return true;
  const Value& u = a.at(x);
  const Value& v = b.at(y);
  if (u.kind != v.kind || u.i != v.i || u.s != v.s || u.name() != v.name() || u.newobj != v.newobj ||
      std::memcmp(&u.f, &v.f, sizeof u.f) != 0 || u.items.size() != v.items.size())
    return false;
  for (size_t k = 0; k < u.items.size(); ++k)
    if (!same(a, u.items[k], b, v.items[k])) return false;
  return same(a, u.callable, b, v.callable) && same(a, u.args, b, v.args) && same(a, u.state, b, v.state) &&
         same(a, u.pid, b, v.pid);
}

}  // namespace

TEST_CASE("pickle emit: dicts, lists, tuples, sets, objects (NEWOBJ + BUILD, REDUCE), OrderedDicts come back equal") {
  Writer w;
  w.empty_dict();
  w.mark();
  w.str("loss_scaler");  // copyreg-style: cls.__new__ + BUILD of its __dict__
  w.global("deepspeed.runtime.fp16.loss_scaler", "LossScaler");
  w.empty_tuple();
  w.newobj();
  w.empty_dict();
  w.mark();
  w.str("cur_scale");
  w.real(1.5);
  w.str("dynamic");
  w.boolean(false);
  w.setitems_from_mark();
  w.build();
  w.str("zero_stage");  // an enum: ZeroStageEnum(2)
  w.global("deepspeed.runtime.zero.config", "ZeroStageEnum");
  w.mark();
  w.integer(2);
  w.tuple_from_mark();
  w.reduce();
  w.str("groups");
  w.empty_list();
  w.mark();
  w.mark();
  w.real(0.9);
  w.real(0.999);
  w.tuple_from_mark();
  w.none();
  w.integer(-70000);
  w.integer(int64_t{1} << 40);
  w.bytes("raw");
  w.appends_from_mark();
  w.str("ordered");
  w.global("collections", "OrderedDict");
  w.empty_tuple();
  w.reduce();
  w.mark();
  w.str("k");
  w.integer(1);
  w.setitems_from_mark();
  w.setitems_from_mark();
  auto a = parse(w.finish());
  REQUIRE(a.ok());
  Writer again;
  REQUIRE(emit(again, *a, a->root(), "test").ok());
  auto b = parse(again.finish());
  REQUIRE(b.ok());
  CHECK(same(*a, a->root(), *b, b->root()));
  // a set, written as set([...])
  auto s = parse(std::string("\x80\x02\x8f(K\x01K\x02\x90.", 10));
  REQUIRE_MESSAGE(s.ok(), s.status().message());
  Writer ws;
  REQUIRE(emit(ws, *s, s->root(), "test").ok());
  auto s2 = parse(ws.finish());
  REQUIRE(s2.ok());
  const Value& made = s2->at(s2->root());
  CHECK(made.kind == Kind::kObject);
  CHECK(s2->is_global(made.callable, "builtins", "set"));
}

TEST_CASE("pickle emit: a value that contains itself, a tensor, too many values are refused") {
  // L = []; L.append(L): EMPTY_LIST BINPUT 0 BINGET 0 APPEND
  auto cyc = parse(std::string("\x80\x02]q\x00h\x00" "a.", 9));
  REQUIRE_MESSAGE(cyc.ok(), cyc.status().message());
  Writer w;
  const Status st = emit(w, *cyc, cyc->root(), "test");
  CHECK(st.message().find("contains itself") != std::string::npos);
  // a persistent id (a tensor's storage)
  Writer t;
  t.mark();
  t.str("storage");
  t.tuple_from_mark();
  t.binpersid();
  auto pid = parse(t.finish());
  REQUIRE(pid.ok());
  Writer w2;
  CHECK(emit(w2, *pid, pid->root(), "test").message().find("persistent id") != std::string::npos);
  // sharing that doubles at every level: [x, x] with x = [y, y], ... 30 levels deep
  std::string deep("\x80\x02", 2);
  deep += std::string("K\x01q\x00" "0", 5);  // 1 -> memo 0, popped
  for (int k = 0; k < 30; ++k) deep += std::string("(h\x00h\x00lq\x00" "0", 9);  // [m0, m0] -> memo 0, popped
  deep += std::string("h\x00.", 3);
  auto d = parse(deep);
  REQUIRE_MESSAGE(d.ok(), d.status().message());
  Writer w3;
  CHECK(emit(w3, *d, d->root(), "test", 1000).message().find("too many values") != std::string::npos);
}

TEST_CASE("pickle: strings stay with the Pickle as it moves; refs past its values read as None; the values cap") {
  // ("a string longer than any small-string buffer", "short", torch.float32's GLOBAL)
  Writer w;
  w.mark();
  w.str("optimizer.state.layers.0.attention.wq.weight.exp_avg");
  w.str("short");
  w.global("torch", "float32");
  w.tuple_from_mark();
  auto parsed = parse(w.finish());
  REQUIRE(parsed.ok());
  Pickle moved = std::move(*parsed);
  Pickle again;
  again = std::move(moved);
  const Value& t = again.at(again.root());
  REQUIRE(t.items.size() == 3);
  CHECK(again.at(t.items[0]).s == "optimizer.state.layers.0.attention.wq.weight.exp_avg");
  CHECK(again.at(t.items[1]).s == "short");
  CHECK(again.is_global(t.items[2], "torch", "float32"));
  const std::string copy = again.at(t.items[0]).s;  // a Text converts to a std::string of its own
  CHECK(copy.size() == 52);
  CHECK(again.at(kNoRef).kind == Kind::kNone);
  CHECK(again.at(static_cast<Ref>(again.size())).kind == Kind::kNone);
  CHECK(Pickle{}.at(0).kind == Kind::kNone);
  CHECK(Pickle{}.size() == 0);
  // more values than the limit: refused by count, not by memory
  Writer many;
  many.mark();
  for (int k = 0; k < 100; ++k) many.integer(k);
  many.tuple_from_mark();
  const std::string bytes = many.finish();
  Limits small;
  small.max_values = 50;
  const auto refused = unpickle(std::as_bytes(std::span(bytes)), "test", small);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().message().find("more than 50 values") != std::string::npos);
  CHECK(unpickle(std::as_bytes(std::span(bytes)), "test").ok());
}

TEST_CASE("pickle: Refs in place and on the heap; ValueArena across its growing and its fixed blocks; TextArena") {
  // Refs: four in place, more moved to the heap, copies and moves keep them
  Refs r;
  CHECK(r.empty());
  std::vector<Ref> want;
  for (Ref k = 0; k < 41; ++k) {
    const Ref one[1] = {k * 7};
    r.append(one);
    want.push_back(k * 7);
    REQUIRE(r.size() == want.size());
    CHECK(std::equal(r.begin(), r.end(), want.begin()));
    Refs copy = r;
    CHECK(std::equal(copy.begin(), copy.end(), want.begin(), want.end()));
    Refs moved = std::move(copy);
    CHECK(copy.empty());
    CHECK(std::equal(moved.begin(), moved.end(), want.begin(), want.end()));
    copy = moved;  // assignment over an emptied one
    CHECK(copy.size() == want.size());
    const size_t two = std::min<size_t>(want.size(), 2);
    moved = Refs(std::span<const Ref>(want.data(), two));  // a heap one assigned an inline one
    CHECK(moved.size() == two);
    CHECK(moved.back() == want[two - 1]);
  }
  CHECK(r.at(40) == 280);
  CHECK_THROWS_AS((void)r.at(41), std::out_of_range);
  const std::span<const Ref> view = r;
  CHECK(view.size() == 41);

  // ValueArena: every index past the growing blocks (2^21 - 32 values) into the fixed ones keeps
  // its own value, none moved as it grows
  ValueArena arena;
  const size_t n = (size_t{1} << 21) + 70000;
  const Value* first = nullptr;
  for (size_t i = 0; i < n; ++i) {
    Value& v = arena.emplace_back();
    v.i = static_cast<int64_t>(i);
    if (i % 3 == 0) {
      const Ref items[5] = {1, 2, 3, 4, static_cast<Ref>(i)};
      v.items.append(items);
    }
    if (i == 0) first = &v;
  }
  REQUIRE(arena.size() == n);
  CHECK(&arena[0] == first);
  bool all = true;
  for (size_t i = 0; i < n; ++i) {
    const Value& v = std::as_const(arena)[i];
    all = all && v.i == static_cast<int64_t>(i) && v.items.size() == (i % 3 == 0 ? 5u : 0u) &&
          (i % 3 != 0 || v.items[4] == static_cast<Ref>(i));
  }
  CHECK(all);

  // TextArena: empty, small, a block's worth and beyond, each kept as given
  TextArena texts;
  std::vector<std::pair<Text, std::string>> kept;
  for (size_t len : {size_t{0}, size_t{1}, size_t{15}, size_t{255}, size_t{256}, size_t{3000}, size_t{1} << 20,
                     (size_t{1} << 20) + 3, size_t{7}}) {
    std::string s(len, 'a');
    for (size_t k = 0; k < len; ++k) s[k] = static_cast<char>('a' + (k * 31 + len) % 26);
    kept.emplace_back(texts.keep(s), s);
  }
  for (int k = 0; k < 5000; ++k) kept.emplace_back(texts.keep(std::to_string(k)), std::to_string(k));
  for (const auto& [t, s] : kept) CHECK(std::string_view(t) == s);
}

TEST_CASE("pickle: share_immutables makes None, () and small ints once; values read the same; off by default") {
  // [None, None, (), (), 7, 7, 70000, 70000, -3, -3, [], []] : the lists stay two (they take items)
  Writer w;
  w.empty_list();
  w.mark();
  for (int k = 0; k < 2; ++k) w.none();
  for (int k = 0; k < 2; ++k) w.empty_tuple();
  for (int k = 0; k < 2; ++k) w.integer(7);
  for (int k = 0; k < 2; ++k) w.integer(70000);
  for (int k = 0; k < 2; ++k) w.integer(-3);
  for (int k = 0; k < 2; ++k) w.empty_list();
  w.appends_from_mark();
  const std::string bytes = w.finish();
  Limits shared;
  shared.share_immutables = true;
  auto on = unpickle(std::as_bytes(std::span(bytes)), "test", shared);
  auto off = unpickle(std::as_bytes(std::span(bytes)), "test");
  REQUIRE(on.ok());
  REQUIRE(off.ok());
  const Refs& a = on->at(on->root()).items;
  const Refs& b = off->at(off->root()).items;
  REQUIRE(a.size() == 12);
  REQUIRE(b.size() == 12);
  CHECK(same(*on, on->root(), *off, off->root()));
  CHECK(a[0] == a[1]);    // None
  CHECK(a[2] == a[3]);    // ()
  CHECK(a[4] == a[5]);    // 7
  CHECK(a[6] != a[7]);    // 70000: past the shared ints
  CHECK(a[8] == a[9]);    // -3
  CHECK(a[10] != a[11]);  // lists are never shared
  CHECK(on->at(a[8]).i == -3);
  CHECK(on->size() < off->size());
  for (size_t k = 0; k < 12; k += 2) CHECK(b[k] != b[k + 1]);
}

TEST_CASE("pickle: the writer memoizes globals and strings (BINPUT once, BINGET after); values come back equal") {
  Writer w;
  w.mark();
  for (int k = 0; k < 300; ++k) {  // past 256 memo entries: LONG_BINPUT / LONG_BINGET
    w.global("torch", "Size");
    w.str("offsets");
    w.str("item." + std::to_string(k));
  }
  w.tuple_from_mark();
  const std::string bytes = w.finish();
  // The GLOBAL and the repeated string written once; each later use a BINGET of 2 or 5 bytes
  // (written out each time, they alone took 300 * (12 + 12) bytes).
  CHECK(bytes.find("torch\nSize\n") == bytes.rfind("torch\nSize\n"));
  CHECK(bytes.find("offsets") == bytes.rfind("offsets"));
  CHECK(bytes.size() < 300 * 20);
  auto parsed = parse(bytes);
  REQUIRE(parsed.ok());
  const Value& t = parsed->at(parsed->root());
  REQUIRE(t.items.size() == 900);
  for (int k = 0; k < 300; ++k) {
    CHECK(parsed->is_global(t.items[3 * k], "torch", "Size"));
    CHECK(parsed->at(t.items[3 * k + 1]).s == "offsets");
    CHECK(parsed->at(t.items[3 * k + 2]).s == "item." + std::to_string(k));
  }
}

TEST_CASE("pickle: a pickle whose values would take more memory than allowed is refused, naming the cap") {
  // A few hundred MB of EMPTY_LIST opcodes made tens of GB of values (the process was killed);
  // each opcode makes a value, so the cap is reached early.
  const std::string lists = std::string("\x80\x02", 2) + std::string(100000, ']');
  Limits small;
  small.max_memory = 1 << 20;
  const auto refused = unpickle(std::as_bytes(std::span(lists)), "x/.metadata", small);
  REQUIRE_FALSE(refused.ok());
  const std::string msg = refused.status().message();
  CHECK(msg.find("x/.metadata") != std::string::npos);
  CHECK(msg.find("GiB of memory") != std::string::npos);
  CHECK(msg.find("quarter") == std::string::npos);  // the caller's cap, not the machine's
  // The default cap is a quarter of the machine's memory: far above this pickle (it only lacks STOP).
  const auto by_machine = unpickle(std::as_bytes(std::span(lists)), "x/.metadata");
  REQUIRE_FALSE(by_machine.ok());
  CHECK(by_machine.status().message().find("ends without STOP") != std::string::npos);
  // A real pickle under the cap reads.
  Writer w;
  w.mark();
  for (int k = 0; k < 100; ++k) w.empty_list();
  w.tuple_from_mark();
  const std::string ok = w.finish();
  CHECK(unpickle(std::as_bytes(std::span(ok)), "y", small).ok());
}

TEST_CASE("pickle: a Global's module and name (one text, the name after the module) for every length, empty too") {
  // STACK_GLOBAL of two strings, each of a length that walks the texts' blocks (256 bytes first,
  // then doubling), with empty modules and names and NUL bytes, then GLOBAL's text form.
  std::string b("\x80\x04(", 3);
  std::vector<std::pair<std::string, std::string>> want;
  auto short_str = [&](const std::string& s) {
    b += '\x8c';
    b += static_cast<char>(s.size());
    b += s;
  };
  for (int k = 0; k < 200; ++k) {
    std::string module = k % 7 == 0 ? "" : "mod" + std::string(static_cast<size_t>(k % 50), 'm');
    std::string name = k % 11 == 0 ? "" : "N" + std::to_string(k) + std::string(static_cast<size_t>(k % 90), 'n');
    if (k % 13 == 5) name += std::string("\0z", 2);
    short_str(module);
    short_str(name);
    b += '\x93';
    want.emplace_back(module, name);
  }
  b += "ctorch\nfloat32\n";
  want.emplace_back("torch", "float32");
  b += "t.";
  auto p = unpickle(std::as_bytes(std::span(b)), "test");
  REQUIRE(p.ok());
  const Value& t = p->at(p->root());
  REQUIRE(t.items.size() == want.size());
  for (size_t k = 0; k < want.size(); ++k) {
    const Value& g = p->at(t.items[k]);
    REQUIRE(g.kind == Kind::kGlobal);
    CHECK(std::string(g.s) == want[k].first);
    CHECK(std::string(g.name()) == want[k].second);
    CHECK(p->is_global(t.items[k], want[k].first, want[k].second));
  }
  CHECK(p->at(t.items[0]).name() != p->at(t.items[1]).name());
  // Values of other kinds have no name.
  CHECK(p->at(p->root()).name().empty());
  CHECK(p->at(kNoRef).name().empty());
}
