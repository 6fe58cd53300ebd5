// Sharded snapshots (include/ddp/sharded_snapshot.h): their names, the
// progress stored with them, finding the newest and pruning the rest.

#include <ddp/sharded_snapshot.h>

#include <ddp/error.h>

#include "fmt_header_only.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>

namespace ddp::detail {
namespace {

namespace fs = std::filesystem;
constexpr const char* kPrefix = "sharded_step_";
constexpr const char* kProgressKey = "ddp_training_progress";

// The snapshots in `dir` as (step, path), newest first. Partial and old
// directories (".partial", ".old") are not snapshots.
std::vector<std::pair<int64_t, std::string>> snapshots_in(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code error;
  if (!fs::is_directory(dir, error)) return found;
  for (const auto& entry : fs::directory_iterator(dir, error)) {
    const std::string name = entry.path().filename().string();
    if (!entry.is_directory() || name.rfind(kPrefix, 0) != 0) continue;
    const std::string digits = name.substr(std::char_traits<char>::length(kPrefix));
    if (digits.empty() || digits.size() > 18 ||
        !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      continue;
    }
    found.emplace_back(std::stoll(digits), entry.path().string());
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return found;
}

}  // namespace

std::string sharded_snapshot_path(const std::string& dir, int64_t step) {
  DDP_CHECK(step >= 0, "ddp: a sharded snapshot needs a step >= 0, got ", step);
  return fmt::format("{}/{}{:012d}", dir, kPrefix, step);
}

DistributedCheckpointOptions::Metadata progress_metadata(const TrainingProgress& progress) {
  nlohmann::json json = {
      {"epoch", progress.epoch}, {"step", progress.step}, {"samples_seen", progress.samples_seen}};
  return {{kProgressKey, json.dump()}};
}

std::optional<std::pair<std::string, TrainingProgress>> newest_sharded_snapshot(const std::string& dir,
                                                                               std::vector<std::string>* skipped) {
  for (const auto& [step, path] : snapshots_in(dir)) {
    try {
      const auto metadata = distributed_checkpoint_metadata(path);
      auto it = metadata.find(kProgressKey);
      DDP_CHECK(it != metadata.end(), "ddp: '", path, "' holds no training progress (", kProgressKey, ")");
      auto json = nlohmann::json::parse(it->second, nullptr, false);
      DDP_CHECK(json.is_object() && json.contains("epoch") && json["epoch"].is_number_integer() &&
                    json.contains("step") && json["step"].is_number_integer() && json.contains("samples_seen") &&
                    json["samples_seen"].is_number_integer(),
                "ddp: the training progress of '", path, "' is damaged");
      TrainingProgress progress;
      progress.epoch = json["epoch"].get<int64_t>();
      progress.step = json["step"].get<int64_t>();
      progress.samples_seen = json["samples_seen"].get<int64_t>();
      DDP_CHECK(progress.epoch >= 0 && progress.step == step && progress.samples_seen >= 0,
                "ddp: the training progress of '", path, "' does not match its name");
      return std::make_pair(path, progress);
    } catch (const std::exception& e) {
      if (skipped) skipped->push_back(e.what());
    }
  }
  return std::nullopt;
}

void prune_sharded_snapshots(const std::string& dir, int keep, ProcessGroup& group) {
  if (group.rank() != 0 || keep <= 0) return;
  const auto found = snapshots_in(dir);
  for (size_t i = static_cast<size_t>(keep); i < found.size(); ++i) {
    std::error_code ignored;  // another attempt may be pruning too
    fs::remove_all(found[i].second, ignored);
  }
}

}  // namespace ddp::detail
