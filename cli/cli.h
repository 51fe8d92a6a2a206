// Shared pieces of the `optstate` command: argument parsing and the error-to-exit-code rule.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <map>
#include <span>
#include <optional>
#include <string>
#include <vector>

#include "optstate/checkpoint.h"
#include "optstate/status.h"

namespace optstate::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFindings = 1;  // validation failed, diff outside tolerance
inline constexpr int kExitError = 2;     // usage or I/O error, unreadable input

struct OptionSpec {
  std::string name;  // "--json"
  bool takes_value = false;
  std::string help;
};

struct CommandSpec {
  std::string name, usage, summary;
  std::vector<OptionSpec> options;
  int min_positional = 0, max_positional = 0;
};

struct Args {
  std::vector<std::string> positional;
  std::map<std::string, std::string> options;  // flags map to ""
  bool has(const std::string& name) const { return options.count(name) != 0; }
  std::optional<std::string> value(const std::string& name) const {
    auto it = options.find(name);
    if (it == options.end()) return std::nullopt;
    return it->second;
  }
};

// Parses argv after the command name. Returns a usage error for unknown options or wrong counts.
// `--help` sets options["--help"].
Result<Args> parse_args(const CommandSpec& spec, int argc, char** argv);
std::string help_text(const CommandSpec& spec);
// "512 B", "1.5 KiB", "3.2 GiB".
std::string human_bytes(double bytes);
// "the model's 2 other tensors (lm_head.weight, bn.running_mean)": a reader's model_tensors(), the
// first few named.
std::string model_tensors_text(std::span<const ModelTensorInfo> tensors);
// Prints "optstate <cmd>: <message>" on stderr and returns kExitError.
int fail(const std::string& command, const Status& status);
// Prints `j` on stdout, indented, one document. Bytes that are not UTF-8 (a path, or the name of an
// entry a file carries, can hold any) are written as U+FFFD rather than failing the output; param
// names never need it (open_checkpoint refuses those that are not text).
void print_json(const nlohmann::json& j);

// While one lives, SIGINT, SIGTERM and SIGHUP stop the checkpoint write in progress instead of
// killing the process: the writer fails with kCancelled and removes its partial output (io.h:
// request_interrupt). A second signal kills at once. Outside it signals act as usual: the commands
// that only read have nothing to clean up.
class InterruptibleWrite {
 public:
  InterruptibleWrite();
  ~InterruptibleWrite();
  InterruptibleWrite(const InterruptibleWrite&) = delete;
  InterruptibleWrite& operator=(const InterruptibleWrite&) = delete;
  // After the write: if a signal stopped it, says so on stderr (naming `destination`) and ends the
  // process by that signal, as the shell expects of an interrupted command; else returns.
  void exit_if_interrupted(const std::string& command, const std::string& destination);
};

int run_inspect(int argc, char** argv);
int run_hash(int argc, char** argv);
int run_convert(int argc, char** argv);
int run_validate(int argc, char** argv);
int run_diff(int argc, char** argv);
int run_reshard(int argc, char** argv);

}  // namespace optstate::cli
