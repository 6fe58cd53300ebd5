// Sharded snapshots (include/ddp/sharded_snapshot.h): their names, the
// progress stored with them, finding the newest, and what SnapshotSaver's
// pruning (src/checkpoint/snapshot_retention.h) needs to know of them.

#include <ddp/sharded_snapshot.h>

#include <ddp/error.h>

#include "common/error_text.h"
#include "common/fmt_header_only.h"
#include "checkpoint/snapshot_retention.h"

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

constexpr const char* kModelPrefix = "model.";

}  // namespace

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

SnapshotListing list_sharded_snapshots(const std::string& dir, const std::string& written) {
  const std::string name = fs::path(written).filename().string();
  const int64_t written_step = std::stoll(name.substr(std::char_traits<char>::length(kPrefix)));
  const TrainingProgress mine = validated_progress(written_step, written);
  const auto model = checkpoint_shapes(written, kModelPrefix);
  SnapshotListing listing{{written, mine.step, mine.epoch, true, resumed_from(written)}, {}};
  const std::string written_path = canonical_path(written);
  for (const auto& [step, path] : snapshots_in(dir)) {
    if (canonical_path(path) == written_path) continue;
    SnapshotOnDisk other{path, step};
    other.resumed_from = resumed_from(path);
    try {
      if (!fs::is_symlink(path)) {
        other.epoch = validated_progress(step, path).epoch;
        other.ours = checkpoint_shapes(path, kModelPrefix) == model;
      }
    } catch (const std::exception&) {
      // incomplete, damaged or foreign: not ours
    }
    listing.others.push_back(std::move(other));
  }
  return listing;
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

void check_not_left_partly_loaded(const std::string& dir, bool partly_loaded, const std::vector<std::string>& why) {
  if (!partly_loaded) return;
  std::string reasons;
  for (const auto& reason : why) reasons += "\n  " + reason;
  DDP_CHECK(false, "ddp: no sharded snapshot in '", dir, "' loads on every rank, and ranks that loaded one the ",
            "others could not now hold different states; remove or repair the snapshots named below and restart:",
            reasons);
}

}  // namespace ddp::detail
