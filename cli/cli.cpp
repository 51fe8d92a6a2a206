#include "cli.h"

#include <fmt/format.h>

#include <cstdio>

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

int fail(const std::string& command, const Status& status) {
  std::fprintf(stderr, "optstate %s: error: %s\n", command.c_str(), status.message().c_str());
  return kExitError;
}

}  // namespace optstate::cli
