// optstate: inspect, hash, validate, diff, convert and reshard AdamW optimizer checkpoints.
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <string>

#include "cli.h"
#include "optstate/io.h"

namespace {

struct Command {
  const char* name;
  int (*run)(int, char**);
  const char* summary;
};

constexpr Command kCommands[] = {
    {"inspect", optstate::cli::run_inspect, "params, entries, shapes, encodings, bytes, steps, statistics"},
    {"hash", optstate::cli::run_hash, "per-entry and root hashes, independent of sharding and format"},
    {"validate", optstate::cli::run_validate, "checksums, coverage and state sanity; exit 1 on findings"},
    {"diff", optstate::cli::run_diff, "per-entry differences between two checkpoints"},
    {"convert", optstate::cli::run_convert, "copy a checkpoint, optionally to fp32 or 8-bit moments"},
    {"reshard", optstate::cli::run_reshard, "lay a checkpoint out as N ranks' shards"},
};

void print_usage(FILE* out) {
  std::fprintf(out, "usage: optstate <command> [options]\n\ncommands:\n");
  for (const auto& c : kCommands) std::fprintf(out, "  %-10s %s\n", c.name, c.summary);
  std::fprintf(out, "\n`optstate <command> --help` describes a command.\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    print_usage(stderr);
    return optstate::cli::kExitError;
  }
  const std::string cmd = argv[1];
  if (cmd == "--help" || cmd == "-h" || cmd == "help") {
    print_usage(stdout);
    return optstate::cli::kExitOk;
  }
  if (cmd == "--version") {
    std::printf("optstate %s\n", OPTSTATE_VERSION);
    return optstate::cli::kExitOk;
  }
  // A DCP write keeps every rank's file open, a native one up to 256: take the hard limit on open
  // files rather than the usual soft 1024 (nothing here uses select()).
  optstate::raise_open_file_limit();
  for (const auto& c : kCommands) {
    if (cmd != c.name) continue;
    // The libraries report errors as Status; an exception reaching here is a bug (or memory running
    // out). Caught, so that the stack unwinds: a write's staging folder is removed, not left behind
    // as an abort leaves it, and the exit is the I/O error's, not a signal.
    try {
      return c.run(argc - 2, argv + 2);
    } catch (const std::bad_alloc&) {
      std::fprintf(stderr, "optstate %s: error: out of memory\n", c.name);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "optstate %s: internal error: %s (a bug in optstate: please report it with the command)\n",
                   c.name, e.what());
    }
    return optstate::cli::kExitError;
  }
  std::fprintf(stderr, "optstate: unknown command '%s' (see optstate --help)\n", cmd.c_str());
  return optstate::cli::kExitError;
}
