// Writing a torch.save file's pickle again with some values replaced: the writers that lay a source
// checkpoint out for another world size (DeepSpeed ZeRO-3's files, FSDP2's per-rank files) keep
// every value of the source's pickle they do not need to change, in the classes and fields of the
// torch version that wrote it. Internal to optstate_formats.
#pragma once

#include <fmt/format.h>

#include <functional>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include "dcp/pickle.h"
#include "optstate/status.h"

namespace optstate::torchsave {

// One file's pickle and the storages its keys name, in key order ("0", "1", ...): each one carried
// from the source file (its key there) or a new tensor the writer describes with a `T`.
template <typename T>
struct Planned {
  std::string pkl;
  std::vector<std::variant<std::string, T>> storages;
};

// Writes a file's pickle `p` again. `replace` may write a value of its own in place of a value
// (returning true); it writes values of `p` it keeps through `carry`. Persistent ids (storages) are
// carried under new keys, each source storage once.
template <typename T>
class Planner {
 public:
  using Carry = std::function<Status(pickle::Ref)>;
  using Replace = std::function<Result<bool>(pickle::Writer&, pickle::Ref, Planned<T>&, const Carry&)>;

  Planner(const pickle::Pickle& p, std::string where) : p_(p), where_(std::move(where)) {}

  Result<Planned<T>> run(const Replace& replace) {
    Planned<T> out;
    carried_.clear();
    pickle::Writer w;
    pickle::EmitHook hook;
    const Carry carry = [&](pickle::Ref r) { return pickle::emit(w, p_, r, where_, hook); };
    hook = [&](pickle::Writer& wr, pickle::Ref r) -> Result<bool> {
      OPTSTATE_ASSIGN_OR_RETURN(const bool replaced, replace(wr, r, out, carry));
      if (replaced) return true;
      if (p_.at(r).kind != pickle::Kind::kPersId) return false;
      OPTSTATE_RETURN_IF_ERROR(persistent_id(wr, p_.at(r), out));
      return true;
    };
    OPTSTATE_RETURN_IF_ERROR(pickle::emit(w, p_, p_.root(), where_, hook));
    out.pkl = w.finish();
    return out;
  }

 private:
  // ('storage', <storage type>, key, location, numel), the key the new file's.
  Status persistent_id(pickle::Writer& w, const pickle::Value& v, Planned<T>& out) {
    const pickle::Value* t = v.pid < p_.size() ? &p_.at(v.pid) : nullptr;
    if (!t || t->kind != pickle::Kind::kTuple || t->items.size() != 5 || p_.at(t->items[2]).kind != pickle::Kind::kStr)
      return corrupt(where_ + ": a persistent id that is not torch.save's storage tuple");
    const std::string& old_key = p_.at(t->items[2]).s;
    auto it = carried_.find(old_key);
    if (it == carried_.end()) {
      it = carried_.emplace(old_key, std::to_string(out.storages.size())).first;
      out.storages.emplace_back(old_key);
    }
    w.mark();
    for (size_t i = 0; i < 5; ++i) {
      if (i == 2) {
        w.str(it->second);
      } else {
        OPTSTATE_RETURN_IF_ERROR(pickle::emit(w, p_, t->items[i], where_));
      }
    }
    w.tuple_from_mark();
    w.binpersid();
    return Status::Ok();
  }

  const pickle::Pickle& p_;
  std::string where_;
  std::map<std::string, std::string> carried_;  // source key -> new key
};

}  // namespace optstate::torchsave
