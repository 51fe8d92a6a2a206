#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "cli.h"
#include "optstate/io.h"
#include "optstate/transform.h"
#include "progress.h"
#include "dcp/dcp_driver.h"
#include "registry.h"

namespace optstate::cli {
namespace {

// Each group key once, in the order keys first appear, with the groups holding it: "param group 0
// 'name'", "param groups 0-4 'initial_lr'", "param groups 0,2,5-9 'lr_scale'".
std::vector<std::string> group_extras_brief(std::span<const GroupExtras> group_extras) {
  std::vector<std::pair<std::string, std::vector<size_t>>> by_key;
  for (size_t g = 0; g < group_extras.size(); ++g)
    for (const auto& extra : group_extras[g]) {
      const std::string& key = extra.first;
      auto it = std::find_if(by_key.begin(), by_key.end(), [&](const auto& kv) { return kv.first == key; });
      if (it == by_key.end()) it = by_key.insert(by_key.end(), {key, {}});
      it->second.push_back(g);
    }
  std::vector<std::string> out;
  for (const auto& [key, groups] : by_key) {
    std::vector<std::string> runs;
    for (size_t i = 0, j = 0; i < groups.size(); i = j) {
      for (j = i + 1; j < groups.size() && groups[j] == groups[j - 1] + 1;) ++j;
      runs.push_back(j - i == 1 ? fmt::format("{}", groups[i]) : fmt::format("{}-{}", groups[i], groups[j - 1]));
    }
    out.push_back(fmt::format("param group{} {} '{}'", groups.size() == 1 ? "" : "s", fmt::join(runs, ","), key));
  }
  return out;
}

Result<int64_t> parse_positive(const std::string& name, const std::string& text) {
  try {
    size_t used = 0;
    const long long v = std::stoll(text, &used);
    if (used == text.size() && v >= 0) return static_cast<int64_t>(v);
  } catch (...) {
  }
  return invalid_argument(fmt::format("{} needs a non-negative integer, got '{}'", name, text));
}

int convert_or_reshard(const char* command, const CommandSpec& spec, int argc, char** argv);

constexpr const char* kTorchaoPackageHelp =
    "torchao, dcp: the Python package whose OptimState8bit the 8-bit moments are: torchao.optim (torchao 0.11 "
    "and later) or torchao.prototype.low_bit_optim (before 0.11) (default: the source's, else torchao.optim)";

}  // namespace

int run_convert(int argc, char** argv) {
  const CommandSpec spec{
      "convert",
      "optstate convert SRC DST [--to fp32|8bit] [--format native|safetensors|hdf5|dcp|torchsave|libtorch|bitsandbytes|torchao|deepspeed] [--world-size N] [--block-size N] "
      "[--min-8bit-size N] [--float-lr] [--torchao-package P] [--bitsandbytes-layout nested|flat] [--overwrite] [--json]",
      "Writes the state of SRC to DST, optionally changing its encoding: --to fp32 dequantizes 8-bit\n"
      "moments, --to 8bit quantizes the moments of params with at least --min-8bit-size elements\n"
      "(default 4096) in blocks of --block-size (default 256); moments that came from 8-bit get their\n"
      "original codes back. A DCP written from a DCP keeps its layout (torchtitan's too) and carries what\n"
      "is not optimizer state (train_state, lr_scheduler, dataloader, ...) unchanged. A DCP holds 8-bit\n"
      "moments as torchao's AdamW8bit items when SRC is such a DCP or with --to 8bit, else dequantized\n"
      "(torch.optim.AdamW's state). SRC is only read.\n"
      "DST is written atomically: it appears complete or not at all. Ctrl-C (SIGINT, SIGTERM, SIGHUP)\n"
      "stops the write and removes what it wrote; an existing DST stays as it was.",
      {{"--to", true, "fp32 or 8bit (default: keep encodings)"},
       {"--format", true, "output format: native, dcp, safetensors, hdf5, torchsave (one file; from a folder of FSDP's per-rank "
        "files and to a folder, those files for --world-size ranks), libtorch (C++ torch::save's optimizer "
        "archive), bitsandbytes or torchao (their AdamW8bit's state_dict), deepspeed (from a DeepSpeed SRC: of "
        "ZeRO-1/2, a universal checkpoint, which DeepSpeed loads on any world size; of ZeRO-3, the same checkpoint for "
        "--world-size ranks) (default: from DST's extension, .safetensors / .h5 / "
        ".hdf5 / .pt / .pth / .bin (torchsave: Accelerate's optimizer.bin), else native)"},
       {"--block-size", true, "8-bit block size (default 256); given, 8-bit moments of another block size are "
                              "requantized in it (else they keep theirs)"},
       {"--min-8bit-size", true, "params with fewer elements stay dense (default 4096)"},
       {"--world-size", true, "lay DST out as N ranks' shards (default 1)"},
       {"--compress", true, "gzip level 1-9 where the format compresses (hdf5, with shuffle)"},
       {"--float-lr", false, "dcp: torch.optim.AdamW's state for a float lr: lr as Python floats also where the source "
                             "kept tensors (torchao), its LR scheduler's lists included, and 8-bit moments dequantized"},
       {"--torchao-package", true, kTorchaoPackageHelp},
       {"--bitsandbytes-layout", true, "bitsandbytes: nested (its state tensors in __bnb_optimizer_quant_state__, as "
        "bitsandbytes 0.49.2 and later save them) or flat (beside step, as earlier releases save them; every release "
        "loads it) (default: the source's, else nested)"},
       {"--overwrite", false, "replace DST if it is a checkpoint (any format) or an empty directory"},
       {"--json", false, "print a JSON summary"}},
      2,
      2};
  return convert_or_reshard("convert", spec, argc, argv);
}

int run_reshard(int argc, char** argv) {
  const CommandSpec spec{"reshard",
                         "optstate reshard SRC DST --world-size N [--format native|dcp|torchsave|deepspeed] [--torchao-package P] "
                         "[--overwrite] [--json]",
                         "Writes SRC again as N ranks' shards (each rank a contiguous flat range of every entry,\n"
                         "whole rows for dense entries, whole blocks for 8-bit ones; nothing is requantized).\n"
                         "--format torchsave with SRC a folder of FSDP's per-rank files (verl's actor/: FSDP2, or FSDP1\n"
                         "with flat parameters) writes that folder for N ranks; --format deepspeed with SRC a ZeRO-3 checkpoint, that checkpoint.\n"
                         "SRC is only read; DST appears complete or not at all (Ctrl-C leaves nothing).",
                         {{"--world-size", true, "number of ranks (required)"},
                          {"--format", true, "output format (default: native): native, dcp, torchsave (FSDP's per-rank "
                                             "files, from such a folder), deepspeed (ZeRO-3, from such a checkpoint)"},
                          {"--torchao-package", true, kTorchaoPackageHelp},
                          {"--overwrite", false, "replace DST if it is a checkpoint (any format) or an empty directory"},
                          {"--json", false, "print a JSON summary"}},
                         2,
                         2};
  return convert_or_reshard("reshard", spec, argc, argv);
}

namespace {

// Whether `inner` is `outer` or lies under it (both resolved: symlinks, "..").
bool contains(const std::filesystem::path& outer, const std::filesystem::path& inner) {
  std::error_code ec;
  const auto o = std::filesystem::weakly_canonical(outer, ec);
  if (ec) return false;
  const auto i = std::filesystem::weakly_canonical(inner, ec);
  if (ec) return false;
  const auto rel = i.lexically_relative(o);
  return !rel.empty() && *rel.begin() != "..";
}

int convert_or_reshard(const char* command, const CommandSpec& spec, int argc, char** argv) {
  auto args = parse_args(spec, argc, argv);
  if (!args.ok()) return fail(command, args.status());
  if (args->has("--help")) {
    std::fputs(help_text(spec).c_str(), stdout);
    return kExitOk;
  }
  const std::filesystem::path src = args->positional[0], dst = args->positional[1];
  const std::string to = args->value("--to").value_or("");
  if (!to.empty() && to != "fp32" && to != "8bit")
    return fail(command, invalid_argument(fmt::format("--to must be fp32 or 8bit, got '{}'", to)));
  std::string format = args->value("--format").value_or("");
  if (format.empty()) {
    const std::string ext = dst.extension().string();
    format = ext == ".safetensors"                           ? "safetensors"
             : ext == ".h5" || ext == ".hdf5"                ? "hdf5"
             : ext == ".pt" || ext == ".pth" || ext == ".bin" ? "torchsave"
                                                             : "native";
  }
  const FormatDriver* driver = find_format(format);
  if (!driver) return fail(command, invalid_argument(fmt::format("unknown output format '{}'", format)));
  if (args->has("--float-lr") && format != "dcp")
    return fail(command, invalid_argument("--float-lr is for --format dcp"));
  if (to == "8bit" && args->has("--float-lr"))
    return fail(command, invalid_argument("--float-lr writes torch.optim.AdamW's state (dense moments); --to 8bit "
                                          "writes torchao's 8-bit items"));
  if (args->has("--torchao-package") && format != "torchao" && format != "dcp")
    return fail(command, invalid_argument(fmt::format("--torchao-package is for --format torchao and dcp (their 8-bit "
                                                      "moments are torchao's classes); {} names none", format)));
  if (auto layout = args->value("--bitsandbytes-layout")) {
    if (format != "bitsandbytes")
      return fail(command, invalid_argument(fmt::format("--bitsandbytes-layout is for --format bitsandbytes; {} is "
                                                        "another format", format)));
    if (*layout != "nested" && *layout != "flat")
      return fail(command, invalid_argument(fmt::format("--bitsandbytes-layout must be nested or flat, got '{}'", *layout)));
  }
  if (args->has("--torchao-package")) {  // checked before SRC is read, as the writer checks it
    WriteOptions check;
    check.torchao_package = *args->value("--torchao-package");
    if (auto p = dcp::written_torchao_package(check); !p.ok()) return fail(command, p.status());
  }
  WriteOptions quantized;
  quantized.quantized = true;
  if (to == "8bit" && !driver->writes_blockwise8(quantized))  // it would quantize, then store the rounded values dense
    return fail(command, invalid_argument(fmt::format("--to 8bit: {} stores moments dense (torch.optim.AdamW's "
                                                      "state); write 8-bit state as native, hdf5, safetensors, dcp, "
                                                      "libtorch, bitsandbytes or torchao", format)));
  QuantizeOptions q;
  for (const char* option : {"--block-size", "--min-8bit-size"})
    if (args->has(option) && to != "8bit")
      return fail(command, invalid_argument(fmt::format("{} is for --to 8bit (it sets how moments are quantized)", option)));
  if (auto v = args->value("--block-size")) {
    auto n = parse_positive("--block-size", *v);
    if (!n.ok()) return fail(command, n.status());
    q.block_size = *n;
    q.reblock = true;  // asked for by name: 8-bit moments of other blocks are requantized into these
  }
  if (auto v = args->value("--min-8bit-size")) {
    auto n = parse_positive("--min-8bit-size", *v);
    if (!n.ok()) return fail(command, n.status());
    q.min_8bit_size = *n;
  }
  q = driver->quantize_rule(q);
  int world = 1;
  if (auto v = args->value("--world-size")) {
    auto n = parse_positive("--world-size", *v);
    if (!n.ok()) return fail(command, n.status());
    if (*n < 1 || *n > 65536) return fail(command, invalid_argument("--world-size must be between 1 and 65536"));
    world = static_cast<int>(*n);
  } else if (std::string(command) == "reshard") {
    return fail(command, invalid_argument("--world-size is required"));
  }
  if (world > 1 && !driver->shards())
    return fail(command, invalid_argument(fmt::format("--world-size {}: {} is one file, not ranks' shards (native and dcp "
                                                      "lay a state out as ranks)", world, format)));
  int compression = 0;
  if (auto v = args->value("--compress")) {
    auto n = parse_positive("--compress", *v);
    if (!n.ok() || *n > 9) return fail(command, invalid_argument("--compress must be a gzip level 1-9"));
    compression = static_cast<int>(*n);
    if (!driver->compresses())
      return fail(command, invalid_argument(fmt::format("--compress: {} stores tensors uncompressed (hdf5 compresses)",
                                                        format)));
  }
  std::error_code ec;
  if (std::filesystem::exists(dst, ec)) {
    if (std::filesystem::equivalent(src, dst, ec))
      return fail(command, invalid_argument(fmt::format("{}: destination is the source", dst.string())));
    if (contains(dst, src))  // replacing DST would delete SRC
      return fail(command, invalid_argument(fmt::format("{}: destination contains the source {}", dst.string(),
                                                        src.string())));
  }

  // Said first: a killed write's leftovers may be why this one runs out of space.
  for (const Leftover& l : find_leftovers(dst))
    std::fprintf(stderr, "note: %s is left from an interrupted write of %s (%s, its process is gone); "
                 "remove it unless a writer on another machine still owns it\n",
                 l.path.c_str(), dst.c_str(), human_bytes(static_cast<double>(l.bytes)).c_str());
  Progress progress(command);
  auto opened = open_with_progress(src, progress);
  if (!opened.ok()) return fail(command, opened.status());
  auto* reader = &static_cast<ProgressReader&>(**opened).inner();  // the source itself, for the writer
  if (std::string(command) == "reshard" && !args->has("--format") && reader->format() == "torchsave" &&
      std::filesystem::is_directory(src, ec))
    std::fprintf(stderr, "note: %s is a folder of per-rank torch.save files; %s is written as a native checkpoint "
                 "(--format torchsave writes those files for %d ranks, which verl resumes from)\n",
                 src.c_str(), dst.c_str(), world);
  if (to == "8bit")
    if (Status qs = check_quantize_options(q); !qs.ok()) return fail(command, qs);
  // Entry by entry: SRC is read as DST is written, one entry in memory at a time.
  auto read = reader_source(**opened);
  auto recoded = recoded_source(*read, to == "fp32" ? Recode::kDequantize : to == "8bit" ? Recode::kQuantize
                                                                                           : Recode::kKeep, q);
  const OptimizerState& written = recoded->meta();
  WriteOptions wo;
  wo.overwrite = args->has("--overwrite");
  wo.world_size = world;
  wo.compression = compression;
  wo.source = reader;
  wo.float_lr = args->has("--float-lr");
  wo.quantized = to == "8bit";
  wo.torchao_package = args->value("--torchao-package").value_or("");
  wo.bitsandbytes_layout = args->value("--bitsandbytes-layout").value_or("");
  progress.phase(fmt::format("writing {}", dst.string()));
  Status st;
  {
    InterruptibleWrite interruptible;
    st = write_checkpoint(*driver, *recoded, dst, wo);
    progress.finish();
    if (!st.ok()) interruptible.exit_if_interrupted(command, dst.string());
  }
  if (!st.ok()) return fail(command, st);

  // Said on stderr even with --json: DST is complete as optimizer state, not as a copy of SRC
  // (unless the driver carried the rest through: DCP from DCP).
  const std::vector<std::string> rest = reader->not_read();
  const bool carried = driver->carries(*reader, dst);
  // The source's other group keys (a scheduler's initial_lr), which the writers of torch's
  // state_dicts keep (by value where they do not carry the source's own bytes).
  std::vector<std::string> extras;
  const std::span<const GroupExtras> group_extras = reader->group_extras();
  for (size_t g = 0; g < group_extras.size(); ++g)
    for (const auto& [key, v] : group_extras[g]) extras.push_back(fmt::format("param group {} '{}'", g, key));
  // As text, each key once with the groups that hold it ("param groups 0-146 'initial_lr'": an
  // optimizer per param has a group per param); JSON lists each group's.
  const std::vector<std::string> extras_brief = group_extras_brief(group_extras);
  const bool extras_kept = carried || driver->keeps_group_extras();
  // What the carrying write keeps of it, and what it does not (how an encoding was read).
  const std::vector<std::string> kept_text = carried ? reader->carried_not_read() : std::vector<std::string>{};
  std::vector<std::string> dropped_text;
  for (const std::string& line : rest)
    if (std::find(kept_text.begin(), kept_text.end(), line) == kept_text.end()) dropped_text.push_back(line);
  // JSON's lists: each group's keys and the model's tensors join them.
  std::vector<std::string> kept_rest = kept_text, dropped = dropped_text;
  std::vector<std::string>& extras_to = extras_kept ? kept_rest : dropped;
  extras_to.insert(extras_to.end(), extras.begin(), extras.end());
  // The model's other tensors beside the weights (buffers, tied names): in the file a torch.save
  // write carries, written as model.<name> items by DCP, else not in DST.
  const std::span<const ModelTensorInfo> model_tensors = reader->model_tensors();
  const bool tensors_kept = carried || driver->keeps_model_tensors();
  if (!model_tensors.empty()) (tensors_kept ? kept_rest : dropped).push_back(model_tensors_text(model_tensors));
  if (!extras_kept) dropped_text.insert(dropped_text.end(), extras_brief.begin(), extras_brief.end());
  if (!model_tensors.empty() && !tensors_kept) dropped_text.push_back(model_tensors_text(model_tensors));
  for (const std::string& note : reader->all_read_notes()) std::fprintf(stderr, "note: %s: %s\n", src.c_str(), note.c_str());
  if (!dropped_text.empty())
    std::fprintf(stderr, "note: %s also holds %s: outside the state read, not in %s\n", src.c_str(),
                 fmt::format("{}", fmt::join(dropped_text, ", ")).c_str(), dst.c_str());
  // What DST keeps of the state (LibTorch's optimizer archive: numbered params, no weights).
  const OptimizerState kept = driver->kept_by_write(written, wo);
  size_t weights = 0, kept_weights = 0;
  for (const auto& [fqn, ps] : written.params) weights += ps.entries.count(kParam);
  for (const auto& [fqn, ps] : kept.params) kept_weights += ps.entries.count(kParam);
  if (weights > kept_weights)
    std::fprintf(stderr, "note: %s holds no weights (%s keeps optimizer state only): %zu params' weights not written\n",
                 dst.c_str(), format.c_str(), weights - kept_weights);
  if (kept.params.size() < written.params.size())
    std::fprintf(stderr, "note: %zu params without optimizer state are not in %s (%s keeps no shape for them)\n",
                 written.params.size() - kept.params.size(), dst.c_str(), format.c_str());
  for (const std::string& note : driver->write_notes(kept, wo))
    std::fprintf(stderr, "note: %s: %s\n", dst.c_str(), note.c_str());
  // LibTorch's archive numbers the params (a write that renames them otherwise says why in its notes).
  bool renamed = false, numbered = true;
  for (const auto& [fqn, ps] : kept.params) {
    renamed = renamed || !written.params.count(fqn);
    numbered = numbered && !fqn.empty() && fqn.find_first_not_of("0123456789") == std::string::npos;
  }
  if (renamed && numbered)
    std::fprintf(stderr, "note: %s numbers the params 0..%zu in group order (%s names none)\n", dst.c_str(),
                 kept.params.size() - 1, format.c_str());
  // bitsandbytes steps 8-bit state in blocks of 256 only, torchao in whole blocks only: others are
  // written as fp32 values.
  size_t widened = 0;
  const bool eight_bit = driver->writes_blockwise8(wo);
  if (eight_bit)
    for (const auto& [fqn, ps] : kept.params)
      for (const auto& [name, e] : ps.entries)
        if (auto w = written.params.find(fqn); w != written.params.end() && w->second.entries.count(name))
          widened += e.encoding == Encoding::kDense && w->second.entries.at(name).encoding == Encoding::kBlockwise8;
  if (widened)
    std::fprintf(stderr, "note: %s stores %zu 8-bit entr%s as fp32 values: %s keeps 8-bit state in its own block "
                 "layout only (formats/%s/FORMAT.md)\n", dst.c_str(), widened, widened == 1 ? "y" : "ies",
                 format.c_str(), format.c_str());
  int64_t dense = 0, eight = 0;
  for (const auto& [fqn, ps] : kept.params)
    for (const auto& [name, e] : ps.entries)  // as written: DCP for torch.optim.AdamW stores 8-bit moments dequantized
      (e.encoding == Encoding::kDense || !eight_bit ? dense : eight) += 1;
  if (args->has("--json")) {
    nlohmann::json j = {{"source", src.string()}, {"source_format", std::string(reader->format())},
                        {"destination", dst.string()}, {"format", format}, {"world_size", world},
                        {"params", kept.params.size()},
                        {"carried", kept_rest},
                        {"not_carried", dropped},
                        {"dense_entries", dense}, {"blockwise8_entries", eight}};
    print_json(j);
  } else {
    std::string tail;
    if (carried && !kept_text.empty())
      tail += fmt::format("; carried {}: {}",
                          wo.float_lr            ? "(tensor lrs as floats)"
                          : format == "torchsave" && std::filesystem::is_directory(dst)
                              ? "for each rank (rank r's from SRC's rank r mod its ranks)"
                              : "unchanged",
                          fmt::join(kept_text, ", "));
    if (extras_kept && !extras.empty()) tail += fmt::format("; kept {}", fmt::join(extras_brief, ", "));
    if (!model_tensors.empty() && tensors_kept) tail += fmt::format("; kept {}", model_tensors_text(model_tensors));
    std::printf("wrote %s (%s, %d rank%s): %zu params, %lld dense and %lld 8-bit entries%s\n", dst.c_str(),
                format.c_str(), world, world == 1 ? "" : "s", kept.params.size(), static_cast<long long>(dense),
                static_cast<long long>(eight), tail.c_str());
  }
  return kExitOk;
}

}  // namespace
}  // namespace optstate::cli
