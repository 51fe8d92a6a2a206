#include "cli.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iterator>

#include "optstate/io.h"

namespace optstate::cli {

Result<Args> parse_args(const CommandSpec& spec, int argc, char** argv) {
  Args args;
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      args.options["--help"] = "";
      return args;
    }
    if (a.size() > 2 && a.rfind("--", 0) == 0) {
      std::string name = a, value;
      bool inline_value = false;
      if (auto eq = a.find('='); eq != std::string::npos) {
        name = a.substr(0, eq);
        value = a.substr(eq + 1);
        inline_value = true;
      }
      const OptionSpec* opt = nullptr;
      for (const auto& o : spec.options)
        if (o.name == name) opt = &o;
      if (!opt) return invalid_argument(fmt::format("unknown option '{}' (see --help)", name));
      if (opt->takes_value && !inline_value) {
        if (i + 1 >= argc) return invalid_argument(fmt::format("option '{}' needs a value", name));
        value = argv[++i];
      } else if (!opt->takes_value && inline_value) {
        return invalid_argument(fmt::format("option '{}' takes no value", name));
      }
      args.options[name] = value;
      continue;
    }
    if (a.empty())  // an unset shell variable: no path names nothing (and "" would resolve to the cwd)
      return invalid_argument(fmt::format("an empty argument where a path goes (usage: {})", spec.usage));
    args.positional.push_back(a);
  }
  const int n = static_cast<int>(args.positional.size());
  if (n < spec.min_positional || n > spec.max_positional)
    return invalid_argument(fmt::format("usage: {}", spec.usage));
  return args;
}

std::string help_text(const CommandSpec& spec) {
  std::string out = fmt::format("usage: {}\n\n{}\n", spec.usage, spec.summary);
  if (!spec.options.empty()) out += "\noptions:\n";
  for (const auto& o : spec.options)
    out += fmt::format("  {:<18} {}\n", o.name + (o.takes_value ? " X" : ""), o.help);
  out += fmt::format("  {:<18} {}\n", "--help", "show this help");
  out += "\nexit status: 0 ok, 1 findings, 2 usage or I/O error\n";
  return out;
}

namespace {

struct StopSignal {
  int number;
  const char* name;
};
constexpr StopSignal kStopSignals[] = {{SIGINT, "SIGINT"}, {SIGTERM, "SIGTERM"}, {SIGHUP, "SIGHUP"}};
struct sigaction g_previous[std::size(kStopSignals)];  // restored when the write is over
bool g_installed[std::size(kStopSignals)];

extern "C" void stop_write(int sig) {
  if (interrupt_signal() != 0) {  // asked twice: stop now (signal and raise are async-signal-safe)
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    return;
  }
  request_interrupt(sig);
}

}  // namespace

InterruptibleWrite::InterruptibleWrite() {
  clear_interrupt();
  struct sigaction sa {};
  sa.sa_handler = stop_write;
  sa.sa_flags = SA_RESTART;  // the writers check the flag themselves; no EINTR for libhdf5 to mishandle
  sigemptyset(&sa.sa_mask);
  for (size_t i = 0; i < std::size(kStopSignals); ++i) {
    // A signal the caller ignores (nohup, a background job of a script) stays ignored.
    g_installed[i] = ::sigaction(kStopSignals[i].number, nullptr, &g_previous[i]) == 0 &&
                     g_previous[i].sa_handler != SIG_IGN && ::sigaction(kStopSignals[i].number, &sa, nullptr) == 0;
  }
}

InterruptibleWrite::~InterruptibleWrite() {
  for (size_t i = 0; i < std::size(kStopSignals); ++i)
    if (g_installed[i]) ::sigaction(kStopSignals[i].number, &g_previous[i], nullptr);
}

void InterruptibleWrite::exit_if_interrupted(const std::string& command, const std::string& destination) {
  const int sig = interrupt_signal();
  if (sig == 0) return;
  const char* name = "a signal";
  for (const StopSignal& s : kStopSignals)
    if (s.number == sig) name = s.name;
  std::fprintf(stderr, "optstate %s: interrupted by %s: %s was not written, and its partial output was removed\n",
               command.c_str(), name, destination.c_str());
  std::fflush(stderr);
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  ::sigaction(sig, &dfl, nullptr);
  ::raise(sig);            // die of it, as the shell expects of an interrupted command
  std::_Exit(128 + sig);  // not reached
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{:.0f} B", b) : fmt::format("{:.1f} {}", b, units[u]);
}

std::string model_tensors_text(std::span<const ModelTensorInfo> tensors) {
  constexpr size_t kNamed = 6;
  std::vector<std::string> names;
  for (size_t i = 0; i < tensors.size() && i < kNamed; ++i) names.push_back(tensors[i].name);
  if (tensors.size() > kNamed) names.push_back(fmt::format("{} more", tensors.size() - kNamed));
  return fmt::format("the model's {} other tensor{} ({})", tensors.size(), tensors.size() == 1 ? "" : "s",
                     fmt::join(names, ", "));
}

void print_json(const nlohmann::json& j) {
  std::fputs((j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n").c_str(), stdout);
}

int fail(const std::string& command, const Status& status) {
  std::fprintf(stderr, "optstate %s: error: %s\n", command.c_str(), status.message().c_str());
  return kExitError;
}

}  // namespace optstate::cli
