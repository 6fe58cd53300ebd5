// Sharded snapshots (include/ddp/sharded_snapshot.h): their names, the
// progress stored with them, finding the newest and pruning the rest.

#include <ddp/sharded_snapshot.h>

#include <ddp/error.h>

#include "fmt_header_only.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>

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

namespace {

// The progress of the snapshot `path` of `step`, once its files are all
// there and read; throws, naming what is wrong.
TrainingProgress validated_progress(int64_t step, const std::string& path) {
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
  return progress;
}

std::string canonical(const std::string& path) {
  std::error_code ec;
  auto result = fs::weakly_canonical(fs::absolute(path, ec), ec);
  return ec ? path : result.string();
}

// The snapshots this process resumed from (one per directory, in practice).
std::mutex resumed_mutex;
std::set<std::string>& resumed_from() {
  static std::set<std::string> paths;
  return paths;
}

constexpr const char* kModelPrefix = "model.";

}  // namespace

std::string message_of(const std::exception& e) {
  const auto* error = dynamic_cast<const c10::Error*>(&e);
  return error ? error->what_without_backtrace() : e.what();
}

std::vector<std::pair<std::string, TrainingProgress>> valid_sharded_snapshots(const std::string& dir,
                                                                            std::vector<std::string>* skipped) {
  std::vector<std::pair<std::string, TrainingProgress>> valid;
  for (const auto& [step, path] : snapshots_in(dir)) {
    try {
      valid.emplace_back(path, validated_progress(step, path));
    } catch (const std::exception& e) {
      if (skipped) skipped->push_back(message_of(e));
    }
  }
  return valid;
}

std::optional<std::pair<std::string, TrainingProgress>> newest_sharded_snapshot(const std::string& dir,
                                                                               std::vector<std::string>* skipped) {
  for (const auto& [step, path] : snapshots_in(dir)) {
    try {
      return std::make_pair(path, validated_progress(step, path));
    } catch (const std::exception& e) {
      if (skipped) skipped->push_back(message_of(e));
    }
  }
  return std::nullopt;
}

void prune_sharded_snapshots(const std::string& dir, const std::string& written, int keep, ProcessGroup& group) {
  if (group.rank() != 0 || keep <= 0) return;
  // The snapshot just written says what this run's snapshots hold. If it
  // does not read back, the older ones are the only fallback: keep them all.
  int64_t written_step = 0;
  std::map<std::string, std::vector<int64_t>> model;
  try {
    const std::string digits = fs::path(written).filename().string().substr(std::char_traits<char>::length(kPrefix));
    written_step = std::stoll(digits);
    validated_progress(written_step, written);
    model = checkpoint_shapes(written, kModelPrefix);
  } catch (const std::exception& e) {
    TORCH_WARN("ddp: the sharded snapshot just written does not read back, so no older one is removed: ",
               message_of(e));
    return;
  }
  std::set<std::string> protected_paths;
  {
    std::lock_guard<std::mutex> lock(resumed_mutex);
    protected_paths = resumed_from();
  }
  const std::string written_path = canonical(written);
  int kept = 1;  // the one just written
  for (const auto& [step, path] : snapshots_in(dir)) {
    if (step >= written_step || canonical(path) == written_path) continue;  // newer ones are never ours to remove
    try {
      validated_progress(step, path);
      if (checkpoint_shapes(path, kModelPrefix) != model) continue;  // another model's: not ours
    } catch (const std::exception&) {
      continue;  // damaged or foreign: neither counted nor removed
    }
    if (kept < keep) {
      ++kept;
      continue;
    }
    if (protected_paths.count(canonical(path))) continue;
    std::error_code ignored;  // another attempt may be pruning too
    fs::remove_all(path, ignored);
  }
}

void agree_on_candidates(ProcessGroup& group, const std::string& dir,
                         const std::vector<std::pair<std::string, TrainingProgress>>& candidates) {
  std::string steps;
  for (const auto& [path, progress] : candidates) steps += std::to_string(progress.step) + " ";
  const auto all = group.all_gather_object(c10::IValue(steps));
  for (size_t rank = 0; rank < all.size(); ++rank) {
    DDP_CHECK(all[rank].toStringRef() == steps, "ddp: the ranks see different sharded snapshots in '", dir,
              "' (steps ", steps.empty() ? "none " : steps, "here, ", all[rank].toStringRef().empty() ? "none " : all[rank].toStringRef(),
              "on rank ", rank, "); every rank must see the same directory (a shared file system)");
  }
}

LoadAgreement agree_on_load(ProcessGroup& group, const std::string& path, const std::string& error,
                            std::vector<std::string>* skipped) {
  const auto all = group.all_gather_object(c10::IValue(error));
  size_t failed = 0;
  std::string first;
  for (size_t rank = 0; rank < all.size(); ++rank) {
    const std::string& theirs = all[rank].toStringRef();
    if (theirs.empty()) continue;
    if (failed++ == 0) {
      first = theirs.find(path) == std::string::npos ? "ddp: the sharded snapshot '" + path + "' does not load: " + theirs
                                                     : theirs;
      if (all.size() > 1) first += " (on rank " + std::to_string(rank) + ")";
    }
  }
  if (failed == 0) return LoadAgreement::kAll;
  if (skipped) skipped->push_back(first);
  return failed == all.size() ? LoadAgreement::kNone : LoadAgreement::kSome;
}

void note_resumed_from(const std::string& path) {
  std::lock_guard<std::mutex> lock(resumed_mutex);
  resumed_from().insert(canonical(path));
}

void check_not_left_partly_loaded(const std::string& dir, bool partly_loaded, const std::vector<std::string>& why) {
  if (!partly_loaded) return;
  std::string reasons;
  for (const auto& reason : why) reasons += "\n  " + reason;
  DDP_CHECK(false, "ddp: no sharded snapshot in '", dir, "' loads on every rank, and ranks that loaded one the ",
            "others could not now hold different states; remove or repair the snapshots named below and restart:",
            reasons);
}

}  // namespace ddp::detail
