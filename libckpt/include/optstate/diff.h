// `optstate diff`: per-entry comparison of two states by their (dequantized) fp32 values.
#pragma once

#include <string>
#include <vector>

#include "optstate/checkpoint.h"

namespace optstate {

struct DiffOptions {
  double rtol = 0.0, atol = 0.0;  // an element differs when |a - b| > atol + rtol * |b| (numpy's allclose rule)
                                  // a hyperparameter when |a - b| > rtol * |b| (atol is for values)
  // Params matched by position instead of by name: the k-th param in group order, which torch
  // numbers k; a side whose params are all numbers ("0", "1", ...: a torch.save without names, a
  // LibTorch archive) keeps its numbers, so params it left out (never stepped) do not shift the rest.
  bool by_position = false;
  // Optimizer state only: weights ("param" entries) and param dtypes are not compared (a format
  // such as LibTorch's optimizer archive holds none).
  bool no_weights = false;
  // Only the params whose name (on either side) matches this shell pattern (fnmatch: `*`, `?`,
  // `[...]`; `.` is no separator): "layers.3.*". Empty: every param. A pattern no param matches
  // is an error, not an empty, equal diff.
  std::string params = {};
};

struct EntryDiff {
  std::string key;                 // "<fqn>.<entry>" (A's fqn; "<fqn A>=<fqn B>.<entry>" when matched by position)
  std::string problem;             // non-empty when the entry cannot be compared (missing, shape)
  int64_t count = 0, outside = 0;  // elements compared, elements outside tolerance
  double max_abs = 0, max_rel = 0;
  bool ok() const { return problem.empty() && outside == 0; }
};

struct DiffReport {
  std::vector<std::string> metadata;  // differences in kind, groups, hyperparameters, steps, dtypes
  std::vector<EntryDiff> entries;
  // Not a finding: what to try when A and B name no param alike (numbered params against named
  // ones, as a torch.save without names against the DCP of the same run): --by-position.
  std::string hint;
  bool ok() const;
};

Result<DiffReport> diff_checkpoints(CheckpointReader& a, CheckpointReader& b, const DiffOptions& options);

}  // namespace optstate
