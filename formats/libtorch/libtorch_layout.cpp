#include "libtorch_layout.h"

#include <fmt/format.h>

#include <cstring>
#include <functional>
#include <set>

#include "dcp/dcp_layout.h"
#include "dcp/pickle.h"
#include "optstate/quant8.h"

namespace optstate::libtorch {

namespace {

// TorchScript accepts `name : Type` for identifiers; other attribute names go in __annotations__.
bool is_identifier(const std::string& s) {
  if (s.empty() || (s[0] >= '0' && s[0] <= '9')) return false;
  for (char c : s)
    if (!(c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'))) return false;
  return true;
}

// Emits the module tree into one pickle, and one TorchScript class per module (as LibTorch's
// OutputArchive makes one per archive level): __torch__.Module for the root, then
// __torch__.___torch_mangle_<n>.Module.
class ModuleTree {
 public:
  struct Attr {
    std::string name, type;
    bool parameter = false;
  };

  // Writes a module whose attributes `body` emits (key then value, through attr()).
  void module(const std::function<void()>& body) {
    const std::string qualified = next_ == 0 ? "__torch__" : fmt::format("__torch__.___torch_mangle_{}", next_ - 1);
    const std::string file = next_ == 0 ? "code/__torch__.py" : fmt::format("code/__torch__/___torch_mangle_{}.py", next_ - 1);
    ++next_;
    w_.global(qualified, "Module");
    w_.empty_tuple();
    w_.newobj();
    w_.empty_dict();
    w_.mark();
    std::vector<Attr> saved;
    saved.swap(attrs_);
    body();
    saved.swap(attrs_);
    w_.setitems_from_mark();
    w_.build();
    code_.emplace_back(file, class_source(saved));
    type_ = qualified + ".Module";
  }

  // An attribute: its name, then `value` writes the value; `type` is its TorchScript type ("" for
  // a module, whose class module() gives).
  void attr(const std::string& name, const std::string& type, const std::function<void()>& value, bool parameter = false) {
    w_.str(name);
    value();
    attrs_.push_back({name, type.empty() ? type_ : type, parameter});
  }

  pickle::Writer& writer() { return w_; }
  std::string finish() { return w_.finish(); }
  std::vector<std::pair<std::string, std::string>>& code() { return code_; }

 private:
  static std::string class_source(const std::vector<Attr>& attrs) {
    std::string params;
    for (const Attr& a : attrs)
      if (a.parameter) params += fmt::format("\"{}\", ", a.name);
    std::string s = fmt::format("class Module(Module):\n  __parameters__ = [{}]\n  __buffers__ = []\n", params);
    bool annotations = false;
    for (const Attr& a : attrs) {
      if (is_identifier(a.name)) continue;
      if (!annotations) s += "  __annotations__ = []\n";
      annotations = true;
      s += fmt::format("  __annotations__[\"{}\"] = {}\n", a.name, a.type);
    }
    for (const Attr& a : attrs)
      if (is_identifier(a.name)) s += fmt::format("  {} : {}\n", a.name, a.type);
    return s;
  }

  pickle::Writer w_;
  std::vector<Attr> attrs_;
  std::vector<std::pair<std::string, std::string>> code_;
  std::string type_;  // the last module's type
  int next_ = 0;
};

std::string int64_bytes(int64_t v) {
  std::string b(8, '\0');
  std::memcpy(b.data(), &v, 8);  // little-endian machines only (byteorder "little")
  return b;
}

}  // namespace

Result<ArchivePlan> plan_archive(const OptimizerState& state, bool dequantize) {
  OPTSTATE_RETURN_IF_ERROR(check_structure(state, false));
  ArchivePlan plan;
  ModuleTree tree;
  std::vector<std::string> order;
  for (const ParamGroup& g : state.groups)
    for (const std::string& fqn : g.params) order.push_back(fqn);
  if (order.size() != state.params.size() || std::set(order.begin(), order.end()).size() != order.size())
    return invalid_argument("libtorch: every param must be in exactly one param group (the archive lists them so)");
  // A param's key: its number. torch::optim pairs state and groups through it (std::stoull), then
  // matches params by position.
  auto key_of = [](size_t i) { return std::to_string(i); };
  auto storage = [&](StorageSpec s, DType dtype, const std::vector<int64_t>& shape) {
    dcp::encode_tensor(tree.writer(), dtype, shape, std::to_string(plan.storages.size()));
    plan.storages.push_back(std::move(s));
  };
  auto count = [&](int64_t n) {
    StorageSpec s;
    s.bytes = int64_bytes(n);
    storage(std::move(s), DType::kI64, {});
  };
  for (const std::string& fqn : order) {
    const ParamState& ps = state.params.at(fqn);
    for (const auto& [name, e] : ps.entries) {
      if (name == kParam) continue;
      if (name != kExpAvg && name != kExpAvgSq && name != kMaxExpAvgSq)
        return invalid_argument(fmt::format("param '{}': entry '{}' has no place in an AdamW archive", fqn, name));
      if (e.encoding == Encoding::kBlockwise8 && !dequantize &&
          e.qmap != qmap_name(name == std::string(kExpAvg) ? QMap::kDynamicSigned : QMap::kDynamicUnsigned))
        return invalid_argument(fmt::format("entry '{}' uses map {}, which optstate's AdamW8bit does not keep for "
                                            "{}; write it with --to fp32", entry_key(fqn, name), e.qmap, name));
    }
    if (ps.entries.count(kExpAvg) != ps.entries.count(kExpAvgSq))
      return invalid_argument(fmt::format("param '{}' has only one of exp_avg and exp_avg_sq", fqn));
  }

  Status failed = Status::Ok();
  tree.module([&] {
    tree.attr("pytorch_version", "str", [&] { tree.writer().str("1.5.0"); });
    tree.attr("state", "", [&] {
      tree.module([&] {
        for (size_t i = 0; i < order.size(); ++i) {
          const ParamState& ps = state.params.at(order[i]);
          if (!ps.entries.count(kExpAvg)) continue;  // never stepped: no state, as torch::optim keeps it
          tree.attr(key_of(i), "", [&] {
            tree.module([&] {
              tree.attr("step", "int", [&] { tree.writer().integer(ps.step); });
              int64_t block = 0;
              for (const char* m : {kExpAvg, kExpAvgSq, kMaxExpAvgSq}) {
                auto it = ps.entries.find(m);
                if (it == ps.entries.end()) continue;
                const Entry& e = it->second;
                if (e.encoding == Encoding::kDense || dequantize) {
                  const DType d = e.encoding == Encoding::kDense ? e.dtype : DType::kF32;
                  tree.attr(m, "Tensor", [&] {
                    storage({order[i], m, Component::kValues, e.encoding != Encoding::kDense, {}}, d, ps.shape);
                  });
                  continue;
                }
                const auto numel = checked_numel(ps.shape);
                if (!numel.ok()) {
                  failed = numel.status();
                  return;
                }
                tree.attr(std::string(m) + "_codes", "Tensor",
                          [&] { storage({order[i], m, Component::kCodes, false, {}}, DType::kU8, ps.shape); });
                tree.attr(std::string(m) + "_absmax", "Tensor", [&] {
                  storage({order[i], m, Component::kAbsmax, false, {}}, DType::kF32,
                          {component_count(e, Component::kAbsmax, *numel)});
                });
                if (block != 0 && block != e.block_size) {
                  failed = invalid_argument(fmt::format("param '{}': moments in blocks of {} and {}; an archive "
                                                        "holds one block_size per param", order[i], block, e.block_size));
                  return;
                }
                block = e.block_size;
              }
              if (block) tree.attr("block_size", "int", [&] { tree.writer().integer(block); });
            });
          });
        }
      });
    });
    tree.attr("param_groups", "", [&] {
      tree.module([&] {
        tree.attr("param_groups/size", "Tensor", [&] { count(static_cast<int64_t>(state.groups.size())); }, true);
        size_t index = 0;
        for (size_t gi = 0; gi < state.groups.size(); ++gi) {
          const ParamGroup& g = state.groups[gi];
          tree.attr(fmt::format("param_groups/{}", gi), "", [&] {
            tree.module([&] {
              tree.attr("params/size", "Tensor", [&] { count(static_cast<int64_t>(g.params.size())); }, true);
              for (size_t j = 0; j < g.params.size(); ++j) {
                const std::string key = key_of(index++);
                tree.attr(fmt::format("params/{}", j), "str", [&] { tree.writer().str(key); });
              }
              tree.attr("options", "", [&] {
                tree.module([&] {
                  const Hyperparameters& h = g.hyper;
                  pickle::Writer& w = tree.writer();
                  tree.attr("lr", "float", [&] { w.real(h.lr); });
                  tree.attr("betas", "Tuple[float, float]", [&] {
                    w.mark();
                    w.real(h.beta1);
                    w.real(h.beta2);
                    w.tuple_from_mark();
                  });
                  tree.attr("eps", "float", [&] { w.real(h.eps); });
                  tree.attr("weight_decay", "float", [&] { w.real(h.weight_decay); });
                  tree.attr("amsgrad", "bool", [&] { w.boolean(h.amsgrad); });
                  tree.attr("maximize", "bool", [&] { w.boolean(h.maximize); });
                });
              });
            });
          });
        }
      });
    });
  });
  OPTSTATE_RETURN_IF_ERROR(failed);
  plan.data_pkl = tree.finish();
  plan.code = std::move(tree.code());
  return plan;
}

}  // namespace optstate::libtorch
