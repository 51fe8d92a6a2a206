// Writing a torch.save file's pickle again with some values replaced: the writers that lay a source
// checkpoint out for another world size (DeepSpeed ZeRO-3's files, FSDP2's per-rank files) keep
// every value of the source's pickle they do not need to change, in the classes and fields of the
// torch version that wrote it. Internal to optstate_formats.
#pragma once

#include <fmt/format.h>

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "dcp/dcp_driver.h"
#include "dcp/pickle.h"
#include "optstate/io.h"
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

// Writers that lay a state out for many ranks write the ranks' files a batch at a time: at most
// kRanksAtOnce open together (well under the usual limit of 1024 open files), each entry loaded once
// per batch and its parts written into every open file in turn.
inline constexpr int kRanksAtOnce = 256;

class RankArchives {
 public:
  // Creates `path` and begins its archive with `pkl`: the archive at index size() - 1.
  Status open(const std::filesystem::path& path, std::string_view pkl) {
    OPTSTATE_ASSIGN_OR_RETURN(OutputFile out, OutputFile::create(path));
    outs_.push_back(std::make_unique<OutputFile>(std::move(out)));
    archives_.push_back(std::make_unique<dcp::ArchiveWriter>(*outs_.back()));
    return archives_.back()->begin(std::as_bytes(std::span(pkl)));
  }
  size_t size() const { return archives_.size(); }
  dcp::ArchiveWriter& operator[](size_t i) { return *archives_[i]; }
  // The same storage written into every archive.
  Status storage_to_all(const std::string& key, std::span<const std::byte> bytes) {
    for (auto& a : archives_) OPTSTATE_RETURN_IF_ERROR(a->storage(key, bytes));
    return Status::Ok();
  }
  // Ends every archive and syncs its file.
  Status finish() {
    for (size_t i = 0; i < archives_.size(); ++i) {
      OPTSTATE_RETURN_IF_ERROR(archives_[i]->finish().status());
      OPTSTATE_RETURN_IF_ERROR(outs_[i]->sync_and_close());
    }
    return Status::Ok();
  }

 private:
  std::vector<std::unique_ptr<OutputFile>> outs_;
  std::vector<std::unique_ptr<dcp::ArchiveWriter>> archives_;
};

}  // namespace optstate::torchsave
