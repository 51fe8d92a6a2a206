// The pickle interpreter's re-emitter (formats/dcp/pickle.h `emit`): what a writer carries from a
// file it read (DeepSpeed's optimizer settings, its loss scaler object, an enum) is written again
// as the same values; cycles, tensors and runaway sharing are refused.
#include <doctest/doctest.h>

#include <cstring>
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
  if (u.kind != v.kind || u.i != v.i || u.s != v.s || u.name != v.name || u.newobj != v.newobj ||
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
