#include "native_sharded.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <optional>

#include "native_manifest.h"
#include "registry.h"
#include "optstate/state_json.h"
#include "optstate/io.h"

namespace optstate::native {
namespace {

std::string default_save_id(const std::filesystem::path& path) {
  static std::mutex mu;
  static std::map<std::string, int> counts;
  std::lock_guard<std::mutex> lock(mu);
  const std::string key = std::filesystem::absolute(path).lexically_normal().string();
  return fmt::format("{}#{}", key, counts[key]++);
}

constexpr const char* kError = "error:";

bool is_error(const std::string& v) { return v.rfind(kError, 0) == 0; }

}  // namespace

OptimizerState local_shard(const OptimizerState& full, int world, int rank) {
  OptimizerState out = full;
  for (auto& [fqn, ps] : out.params)
    for (auto& [name, e] : ps.entries)
      for (Component c : e.components()) {
        const FlatRange r = shard_range(e, c, ps.shape, world, rank);
        const int64_t elem = component_elem_size(e, c);
        Buffer& b = e.buffer(c);
        b.data += r.begin * elem;  // a view into the same storage; the owner keeps it alive
        b.size = static_cast<size_t>(r.size() * elem);
      }
  return out;
}

Status save_sharded(const OptimizerState& local, const std::filesystem::path& path, Coordinator& coord,
                    const ShardedSaveOptions& options) {
  const int rank = coord.rank(), world = coord.world_size();
  const std::string id = "optstate/save/" + (options.save_id.empty() ? default_save_id(path) : options.save_id);
  OPTSTATE_RETURN_IF_ERROR(check_structure(local, false));
  // Every rank holds the same groups, so every rank refuses alike, before anything is agreed.
  OPTSTATE_RETURN_IF_ERROR(check_json_numbers(local).with_context(path.string()));

  // 1. Rank 0 makes the staging directory beside the destination and tells everyone its name. It owns
  // it: whatever ends this call on rank 0 without a commit (an error, an exception) removes it.
  std::optional<Staging> owned;
  if (rank == 0) {
    std::string staging_value;
    if (Status dst = check_destination(path, options.overwrite); !dst.ok()) {
      staging_value = kError + dst.message();
    } else if (auto staging = Staging::directory(path); !staging.ok()) {
      staging_value = kError + staging.status().message();
    } else {
      owned.emplace(std::move(*staging));
      staging_value = ::mkdir((owned->path() / "data").c_str(), 0755) == 0
                          ? owned->path().string()
                          : kError + fmt::format("{}: cannot create data directory", owned->path().string());
    }
    OPTSTATE_RETURN_IF_ERROR(coord.set(id + "/staging", staging_value));
  }
  OPTSTATE_ASSIGN_OR_RETURN(std::string staging, coord.get(id + "/staging", options.timeout));
  if (is_error(staging)) return invalid_argument(staging.substr(6));

  // 2. Every rank writes and fsyncs its own file, then reports its chunks (or its failure).
  auto written = write_rank_file(local, staging, world, rank);
  OPTSTATE_RETURN_IF_ERROR(coord.set(fmt::format("{}/rank/{}", id, rank),
                                     written.ok() ? encode_rank_file(*written)
                                                  : kError + written.status().message()));

  // 3. Rank 0 commits once every rank has reported success; anything else means no commit.
  if (rank == 0) {
    Status st;
    Manifest m;
    m.state = local;
    for (int r = 0; r < world && st.ok(); ++r) {
      auto report = coord.get(fmt::format("{}/rank/{}", id, r), options.timeout);
      if (!report.ok()) {
        st = report.status().with_context(fmt::format("rank {} did not report", r));
      } else if (is_error(*report)) {
        st = io_error(fmt::format("rank {} failed: {}", r, report->substr(6)));
      } else {
        auto rf = decode_rank_file(*report);
        if (!rf.ok()) st = rf.status().with_context(fmt::format("rank {}", r));
        else add_rank_file(m, staging, r, *rf);
      }
    }
    // The manifest parser re-checks coverage: every element of every entry exactly once.
    if (st.ok()) {
      for (auto& [key, list] : m.chunks)
        std::sort(list.begin(), list.end(), [](const Chunk& a, const Chunk& b) { return a.begin < b.begin; });
      const std::string text = serialize_manifest(m);
      st = check_manifest_size(text.size(), m.state.params.size(), kManifestName);
      if (st.ok()) {
        auto check = parse_manifest(std::as_bytes(std::span(text)), staging);
        st = check.ok() ? Status::Ok() : check.status().with_context("assembled manifest");
      }
      if (st.ok()) st = fsync_directory(std::filesystem::path(staging) / "data");
      if (st.ok()) st = write_small_file(std::filesystem::path(staging) / kManifestName, std::as_bytes(std::span(text)));
    }
    st = owned->commit(st, options.overwrite);
    OPTSTATE_RETURN_IF_ERROR(coord.set(id + "/result", st.ok() ? "ok" : kError + st.message()));
    // Rank 0 may host the store (c10d): stay until every rank has read the verdict. A rank that
    // died meanwhile only makes this wait time out; the outcome is already decided.
    for (int r = 1; r < world; ++r) (void)coord.get(fmt::format("{}/done/{}", id, r), options.timeout);
    return st;
  }
  // 4. The others wait for the verdict.
  OPTSTATE_ASSIGN_OR_RETURN(std::string result, coord.get(id + "/result", options.timeout));
  OPTSTATE_RETURN_IF_ERROR(coord.set(fmt::format("{}/done/{}", id, rank), "1"));
  if (result != "ok") return io_error(fmt::format("{}: sharded save not committed: {}", path.string(),
                                                  is_error(result) ? result.substr(6) : result));
  return Status::Ok();
}

}  // namespace optstate::native
