// Distributed checkpoints (include/ddp/distributed_checkpoint.h): which boxes
// of which tensors each rank writes and reads, for FSDP's flat shards and
// for DDP's and ZeRO's replicated model, and the directory's commit. The
// file format is safetensors_io.h.

#include <ddp/distributed_checkpoint.h>
#include <ddp/diloco.h>

#include <ddp/error.h>
#include <ddp/snapshot.h>

#include "common/fmt_header_only.h"
#include "checkpoint/optimizer_state.h"
#include "checkpoint/safetensors_io.h"
#include "common/shard_range.h"
#include "launch/test_seams.h"

#include <ATen/Functions.h>
#include <torch/optim/optimizer.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <set>
#include <unordered_map>
#include <thread>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

namespace ddp::detail {

// The __metadata__ entry of rank 0's first file that holds the optimizer's
// hyperparameters, which safetensors cannot store as tensors.
constexpr const char* kParamGroupsKey = "ddp_param_groups";

namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

std::vector<int64_t> int_list(const c10::IValue& value) {
  std::vector<int64_t> out;
  for (const c10::IValue& item : value.toList()) out.push_back(item.toInt());
  return out;
}

struct Names {
  const DistributedCheckpointOptions& options;
  static std::string join(const std::string& prefix, const std::string& rest) {
    return prefix.empty() ? rest : prefix + "." + rest;
  }
  std::string model(const std::string& fqn) const { return join(options.model_prefix(), fqn); }
  std::string optimizer(const std::string& fqn, const std::string& key) const {
    return join(options.optimizer_prefix(), "state." + fqn + "." + key);
  }
  std::string optimizer_entries(const std::string& fqn) const {
    return join(options.optimizer_prefix(), "state." + fqn + ".");
  }
  std::function<std::string(const std::string&)> optimizer_entries_of() const {
    return [prefix = options.optimizer_prefix()](const std::string& fqn) { return join(prefix, "state." + fqn + "."); };
  }
};

// Elements [begin, end) of the tensor `key` of `shape`, whose element i lies
// at flat[i - flat_first], as boxes that view `flat`.
void add_boxes(std::vector<TensorBox>& out, const std::string& key, const std::vector<int64_t>& shape,
               const at::Tensor& flat, int64_t flat_first, int64_t begin, int64_t end) {
  for (auto& [offsets, sizes] : boxes_of_flat_range(begin, end, shape)) {
    int64_t first = 0;
    for (size_t d = 0; d < shape.size(); ++d) first = first * shape[d] + offsets[d];
    out.push_back(TensorBox{key, offsets, flat.narrow(0, first - flat_first, element_count(sizes)).view(sizes)});
  }
}

// A whole tensor that every rank holds: each writes its equal part.
void add_replicated(std::vector<TensorBox>& out, const std::string& key, const at::Tensor& tensor, int rank,
                    int world) {
  at::Tensor flat = tensor.detach().contiguous().view({-1});
  const ShardRange part = balanced_part(flat.numel(), world, rank);
  add_boxes(out, key, tensor.sizes().vec(), flat, 0, part.begin, part.end);
}

void check_shape(const SafetensorsIndex& index, const std::string& key, at::IntArrayRef shape) {
  const auto stored = index.shape_of(key);
  DDP_CHECK(stored == shape.vec(), "ddp: '", key, "' has shape ", at::IntArrayRef(stored),
            " in the checkpoint but ", shape, " in the model; load a checkpoint of this model");
}

// --- the optimizer's hyperparameters -----------------------------------------

Json param_groups_json(const c10::IValue& optimizer) {
  Json groups = Json::array();
  for (const c10::IValue& group : parse_optimizer_state(optimizer, "save_distributed_checkpoint").param_groups) {
    Json g = Json::object();
    for (const auto& item : group.toGenericDict()) {
      const std::string name = item.key().toStringRef();
      const c10::IValue& v = item.value();
      if (name == "params") continue;
      if (v.isDouble()) g[name] = v.toDouble();
      else if (v.isBool()) g[name] = v.toBool();
      else if (v.isInt()) g[name] = v.toInt();
      else if (v.isTuple()) {
        Json values = Json::array();
        for (const auto& e : v.toTupleRef().elements()) values.push_back(e.toDouble());
        g[name] = values;
      }
    }
    groups.push_back(g);
  }
  return groups;
}

// `current`'s param_groups with the stored hyperparameters put back.
c10::impl::GenericList restored_param_groups(const OptimizerStateParts& current, const std::string& stored) {
  if (stored.empty()) return current.param_groups;
  Json groups = Json::parse(stored, nullptr, false);
  DDP_CHECK(groups.is_array() && groups.size() == current.param_groups.size(), "ddp: the checkpoint's ",
            kParamGroupsKey, " does not match the optimizer's ", current.param_groups.size(), " parameter groups");
  c10::impl::GenericList out(c10::AnyType::get());
  for (size_t i = 0; i < groups.size(); ++i) {
    auto group = current.param_groups.get(i).toGenericDict().copy();
    for (const auto& item : current.param_groups.get(i).toGenericDict()) {
      const std::string name = item.key().toStringRef();
      if (!groups[i].contains(name)) continue;
      const Json& v = groups[i][name];
      const c10::IValue& was = item.value();
      if (was.isDouble() && v.is_number()) group.insert_or_assign(name, v.get<double>());
      else if (was.isBool() && v.is_boolean()) group.insert_or_assign(name, v.get<bool>());
      else if (was.isInt() && v.is_number_integer()) group.insert_or_assign(name, v.get<int64_t>());
      else if (was.isTuple() && v.is_array()) {
        std::vector<c10::IValue> values;
        for (const auto& e : v) values.emplace_back(e.get<double>());
        group.insert_or_assign(name, c10::ivalue::Tuple::create(std::move(values)));
      }
    }
    out.push_back(group);
  }
  return out;
}

// --- optimizer state as named tensors -----------------------------------------

using EntriesOf = std::function<std::string(const std::string& fqn)>;

// `optimizer`'s state (Python's layout; position i is the parameter fqns[i])
// as boxes named entries_of(fqn) + key: whole tensors when `whole` (this
// rank's own state), else this rank's equal part of state every rank holds.
void add_optimizer_state(std::vector<TensorBox>& boxes, const c10::IValue& optimizer,
                         const std::vector<std::string>& fqns, const EntriesOf& entries_of, bool whole, int rank,
                         int world) {
  auto parts = parse_optimizer_state(optimizer, "save_distributed_checkpoint");
  for (const auto& item : parts.state) {
    const int64_t position = item.key().toInt();
    DDP_CHECK(position >= 0 && position < static_cast<int64_t>(fqns.size()), "ddp: the optimizer has state for ",
              "parameter ", position, " but is built over ", fqns.size(), "; build it over model.parameters()");
    for (const auto& entry : item.value().toGenericDict()) {
      const std::string key = entries_of(fqns[position]) + entry.key().toStringRef();
      const at::Tensor value = entry.value().toTensor();
      if (whole) boxes.push_back(TensorBox{key, std::vector<int64_t>(value.dim(), 0), value.detach()});
      else add_replicated(boxes, key, value, rank, world);
    }
  }
}

// What add_optimizer_state wrote, in `current`'s layout (its param_groups,
// with the hyperparameters `stored_groups` holds put back); position i is
// params[i] = (fqn, tensor), whose shape per-element entries take.
c10::IValue read_optimizer_state(const SafetensorsIndex& index, const c10::IValue& current_value,
                                 const std::vector<std::pair<std::string, at::Tensor>>& params,
                                 const EntriesOf& entries_of, const std::string& stored_groups) {
  auto current = parse_optimizer_state(current_value, "load_distributed_checkpoint");
  auto state = new_generic_dict();
  for (size_t position = 0; position < params.size(); ++position) {
    const std::string prefix = entries_of(params[position].first);
    const at::Tensor& param = params[position].second;
    auto entry = new_generic_dict();
    for (const auto& key : index.keys_with_prefix(prefix)) {
      const std::string name = key.substr(prefix.size());
      if (name.find('.') != std::string::npos) continue;
      TensorBox box{key, {}, {}};
      if (is_per_element_state(name)) {
        check_shape(index, key, param.sizes());
        box.data = at::empty_like(param.detach(), param.options().requires_grad(false));
      } else {
        box.data = at::zeros({}, at::kFloat);
      }
      box.offsets.assign(box.data.dim(), 0);
      index.read_into(box);
      entry.insert(name, box.data);
    }
    if (entry.size() > 0) state.insert(static_cast<int64_t>(position), entry);
  }
  return make_optimizer_state(state, restored_param_groups(current, stored_groups));
}

// --- the directory -----------------------------------------------------------

// The files DCP's distributed HuggingFace writer names (ddp's and Python's):
// shard-<rank+1>-model-<k>-of-<n>.safetensors.
const std::regex& shard_file_pattern() {
  static const std::regex pattern(R"(shard-([0-9]{5,9})-model-([0-9]{5,9})-of-([0-9]{5,9})\.safetensors)");
  return pattern;
}

// A shard file's temporary, left in DIR.partial by a save that was killed
// mid-write (write_file_atomically names them "<name>.tmp.<pid>.<random>").
const std::regex& shard_temporary_pattern() {
  static const std::regex pattern(
      R"(shard-[0-9]{5,9}-model-[0-9]{5,9}-of-[0-9]{5,9}\.safetensors\.tmp\.[0-9]+(\.[0-9A-Za-z]+)?)");
  return pattern;
}

// The world size rank 0 records, so that a load can tell a rank's missing
// files from a rank that wrote none (every ddp rank writes at least one).
constexpr const char* kWorldSizeKey = "ddp_world_size";

void fsync_directory(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

std::string parent_of(const std::string& path) {
  const std::string parent = fs::path(path).parent_path().string();
  return parent.empty() ? "." : parent;
}

// Why a save may not replace what is at `path`: "" when nothing is there or
// only what a checkpoint holds. Anything else may be the user's, and a save
// that removed it would lose data nobody asked it to touch.
std::string why_not_a_checkpoint(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    return errno == ENOENT ? "" : std::string("cannot be examined: ") + std::strerror(errno);
  }
  if (S_ISLNK(st.st_mode)) return "is a symbolic link";
  if (!S_ISDIR(st.st_mode)) return "is a file, not a checkpoint directory";
  std::error_code ec;
  for (fs::directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!std::regex_match(name, shard_file_pattern()) && !std::regex_match(name, shard_temporary_pattern())) {
      return "holds '" + name + "', which no checkpoint holds";
    }
    if (!it->is_regular_file(ec) || it->is_symlink(ec)) return "holds '" + name + "', which is not a regular file";
  }
  if (ec) return "cannot be listed: " + ec.message();
  return "";
}

void check_replaceable(const std::string& path, const std::string& target) {
  const std::string why = why_not_a_checkpoint(path);
  DDP_CHECK(why.empty(), "ddp: cannot save a checkpoint into '", target, "': '", path, "' ", why,
            ". A save replaces only a previous checkpoint (files shard-*-model-*-of-*.safetensors and nothing "
            "else); move what is there away, or save into another directory");
}

std::string host_name() {
  char name[256] = {};
  return ::gethostname(name, sizeof(name) - 1) == 0 ? name : "unknown host";
}

// Held by rank 0 of the saving job from before anything is written until
// the commit, so that two jobs saving into one DIR cannot delete each
// other's files: the second fails at once, naming the first. The lock file
// (DIR.lock) holds who that is; its holder removes it at the end, and a
// taker checks that the file it locked is still the one at the path.
class SaveLock {
 public:
  SaveLock(const std::string& target, bool* supported) : path_(target + ".lock") {
    for (int attempt = 0; attempt < 100; ++attempt) {
      fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
      DDP_CHECK(fd_ >= 0, "ddp: cannot create the lock file '", path_, "' of the checkpoint '", target,
                "': ", std::strerror(errno), "; its directory must be writable");
      if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
        const int error = errno;
        std::string holder = contents();
        // Its holder writes who it is right after taking it: give it a moment.
        for (int wait = 0; holder.empty() && error == EWOULDBLOCK && wait < 20; ++wait) {
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
          holder = contents();
        }
        ::close(fd_);
        fd_ = -1;
        if (error == ENOLCK || error == EOPNOTSUPP || error == ENOSYS) {
          *supported = false;  // a file system without locks: saves are unguarded, as before
          return;
        }
        DDP_CHECK(error != EWOULDBLOCK, "ddp: another job is saving a checkpoint into '", target, "' (",
                  holder.empty() ? "it has not yet written who it is into '" + path_ + "'" : holder,
                  "); two jobs saving into one directory would destroy each other's checkpoint, so this save ",
                  "stops. Give each job a directory of its own, or save once the other job is done");
        DDP_CHECK(false, "ddp: cannot lock '", path_, "': ", std::strerror(error));
      }
      struct stat locked {}, now {};
      if (::fstat(fd_, &locked) == 0 && ::stat(path_.c_str(), &now) == 0 && locked.st_dev == now.st_dev &&
          locked.st_ino == now.st_ino) {
        const std::string holder = fmt::format("host {}, pid {}, job '{}', since {} UTC", host_name(), ::getpid(),
                                               default_run_id(), utc_now());
        if (::ftruncate(fd_, 0) == 0) {
          [[maybe_unused]] auto written = ::pwrite(fd_, holder.data(), holder.size(), 0);
        }
        return;
      }
      ::close(fd_);  // its holder removed it after we opened it: lock the new one
      fd_ = -1;
    }
    DDP_CHECK(false, "ddp: cannot lock '", path_, "': it keeps being replaced");
  }
  ~SaveLock() {
    if (fd_ < 0) return;
    ::unlink(path_.c_str());  // before the unlock, so that no taker keeps a removed file
    ::close(fd_);
  }
  SaveLock(const SaveLock&) = delete;
  SaveLock& operator=(const SaveLock&) = delete;

 private:
  std::string contents() const {
    char buffer[512] = {};
    const ssize_t n = ::pread(fd_, buffer, sizeof(buffer) - 1, 0);
    return n > 0 ? std::string(buffer, static_cast<size_t>(n)) : std::string();
  }
  static std::string utc_now() {
    const std::time_t now = std::time(nullptr);
    std::tm tm {};
    ::gmtime_r(&now, &tm);
    char text[32];
    std::strftime(text, sizeof(text), "%Y-%m-%d %H:%M:%S", &tm);
    return text;
  }
  std::string path_;
  int fd_ = -1;
};

// Every rank learns whether every rank succeeded, and why not: a failure on
// one is an error on all, instead of the others waiting in a barrier until
// timeout. The rank where it happened throws its own error; the others a
// PeerFailure quoting it, so that a launcher names the cause, not them.
void agree_on_success(ProcessGroup& group, const std::string& error, const char* what) {
  const auto all = group.all_gather_object(c10::IValue(error));
  DDP_CHECK(error.empty(), error);
  for (size_t rank = 0; rank < all.size(); ++rank) {
    const std::string& theirs = all[rank].toStringRef();
    DDP_PEER_CHECK(theirs.empty(), "ddp: rank ", rank, " failed ", what, ", so this rank stops too; rank ", rank,
                   " said: ", theirs);
  }
}

std::string error_text(const std::exception& e) {
  const auto* error = dynamic_cast<const c10::Error*>(&e);
  return error ? error->what_without_backtrace() : e.what();
}

// Removes what a commit replaced. The new checkpoint is in place by then, so
// a failure here is no failure of the save.
void remove_replaced(const std::string& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
  if (ec) TORCH_WARN("ddp: the checkpoint was saved, but its predecessor '", path, "' could not be removed: ", ec.message());
}

// Makes `partial` the checkpoint `target`. Never leaves `target` missing:
// an atomic exchange where the file system has one, else two renames that
// put the old one back if the second fails.
void commit_directory(const std::string& partial, const std::string& target) {
  struct stat st {};
  if (::lstat(target.c_str(), &st) != 0) {
    fs::rename(partial, target);
  } else if (::renameat2(AT_FDCWD, partial.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0) {
    remove_replaced(partial);  // now the previous checkpoint
  } else {
    DDP_CHECK(errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP, "ddp: cannot move '", partial, "' to '",
              target, "': ", std::strerror(errno));
    const std::string old = target + ".old";
    check_replaceable(old, target);
    fs::remove_all(old);
    fs::rename(target, old);
    std::error_code failed;
    fs::rename(partial, target, failed);
    if (failed) {
      std::error_code ignored;
      fs::rename(old, target, ignored);
      throw fs::filesystem_error("cannot rename", partial, target, failed);
    }
    remove_replaced(old);
  }
}

// Writes `boxes` as this rank's files of DIR.partial, then, once every rank
// has, makes DIR.partial the checkpoint DIR. What is at DIR must be a
// previous checkpoint; that is checked, under the lock, before anything is
// written, and a failed save removes its DIR.partial.
void commit_boxes(const std::string& dir, const std::vector<TensorBox>& boxes,
                  const std::map<std::string, std::string>& rank0_metadata, ProcessGroup& group) {
  DDP_CHECK(!dir.empty(), "ddp: save_distributed_checkpoint needs a directory");
  fs::path normal = fs::path(dir).lexically_normal();
  if (!normal.has_filename() && normal.has_parent_path()) normal = normal.parent_path();  // "ckpt/"
  const std::string target = normal.string();
  const std::string partial = target + ".partial";
  std::optional<SaveLock> lock;
  std::string error;
  if (group.rank() == 0) {
    try {
      fs::create_directories(parent_of(target));
      bool locks_supported = true;
      lock.emplace(target, &locks_supported);
      if (!locks_supported) {
        lock.reset();
        TORCH_WARN_ONCE("ddp: the file system of '", target, "' has no file locks, so two jobs saving into one ",
                        "directory are not detected; give each job its own");
      }
      // A commit interrupted between its renames (where there is no atomic
      // exchange) left the previous checkpoint as DIR.old: restore it.
      struct stat st {};
      if (::lstat(target.c_str(), &st) != 0 && errno == ENOENT && fs::is_directory(target + ".old") &&
          why_not_a_checkpoint(target + ".old").empty()) {
        fs::rename(target + ".old", target);
      }
      check_replaceable(target, target);
      check_replaceable(partial, target);
      fs::remove_all(partial);  // what an interrupted save left
      fs::create_directory(partial);
    } catch (const std::exception& e) {
      error = error_text(e);
      if (error.rfind("ddp: ", 0) != 0) error = "ddp: cannot prepare '" + partial + "': " + error;
    }
  }
  agree_on_success(group, error, "to prepare the checkpoint directory");

  // The k-th box of each tensor goes to file k. Every rank writes at least
  // one file, so that a load can tell which are missing.
  std::map<std::string, size_t> seen;
  std::vector<std::vector<TensorBox>> files;
  for (const auto& box : boxes) {
    const size_t k = seen[box.key]++;
    if (files.size() <= k) files.resize(k + 1);
    files[k].push_back(box);
  }
  if (files.empty()) files.resize(1);
  auto metadata = rank0_metadata;
  if (group.rank() == 0) metadata[kWorldSizeKey] = std::to_string(group.size());
  try {
    for (size_t k = 0; k < files.size(); ++k) {
      const std::string name = fmt::format("shard-{:05d}-model-{:05d}-of-{:05d}.safetensors", group.rank() + 1, k + 1,
                                           files.size());
      write_safetensors_file(partial + "/" + name, files[k],
                             k == 0 && group.rank() == 0 ? metadata : std::map<std::string, std::string>{});
    }
  } catch (const std::exception& e) {
    error = error_text(e);
  }
  try {
    agree_on_success(group, error, "to write its part of the checkpoint");
  } catch (...) {
    // Every rank has stopped writing: the partial files would only keep a
    // full disk full.
    if (group.rank() == 0) {
      std::error_code ignored;
      fs::remove_all(partial, ignored);
    }
    throw;
  }

  if (group.rank() == 0) {
    try {
      // Zero outside tests, which hold the commit back so that a second job's save surely meets it.
      if (const auto delay = detail::test_seams().checkpoint_commit_delay; delay.count() > 0) {
        std::this_thread::sleep_for(delay);
      }
      fsync_directory(partial);
      commit_directory(partial, target);
      fsync_directory(parent_of(target));
    } catch (const std::exception& e) {
      error = std::string("ddp: cannot commit the checkpoint '") + target + "': " + error_text(e);
      std::error_code ignored;
      fs::remove_all(partial, ignored);
    }
    lock.reset();
  }
  agree_on_success(group, error, "to commit the checkpoint");
}

// The checkpoint a load reads: DIR, or DIR.old where a commit without an
// atomic exchange was interrupted between its renames.
std::string committed_directory(const std::string& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec) && fs::is_directory(dir + ".old", ec)) return dir + ".old";
  return dir;
}

// Names a missing file of the checkpoint: without this, its absence shows
// up only as a tensor smaller than the model's ("shape [9, 8] in the
// checkpoint but [16, 8]"), which blames the model.
void check_no_file_missing(const std::string& dir, const SafetensorsIndex& index) {
  std::map<int64_t, std::pair<int64_t, std::set<int64_t>>> ranks;  // shard -> (of n, files present)
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::smatch match;
    const std::string name = it->path().filename().string();
    if (!std::regex_match(name, match, shard_file_pattern())) continue;
    const int64_t shard = std::stoll(match[1]), k = std::stoll(match[2]), n = std::stoll(match[3]);
    auto& [count, present] = ranks[shard];
    DDP_CHECK(count == 0 || count == n, "ddp: the checkpoint in '", dir, "' holds files of shard ", shard,
              " that say it wrote ", count, " and ", n, " files; files of two checkpoints are mixed");
    count = n;
    present.insert(k);
  }
  for (const auto& [shard, files] : ranks) {
    for (int64_t k = 1; k <= files.first; ++k) {
      DDP_CHECK(files.second.count(k), "ddp: the checkpoint in '", dir, "' lacks '",
                fmt::format("shard-{:05d}-model-{:05d}-of-{:05d}.safetensors", shard, k, files.first), "' (file ", k,
                " of the ", files.first, " that rank ", shard - 1,
                " wrote): it was deleted or never written; load an older checkpoint");
    }
  }
  const std::string world = index.metadata(kWorldSizeKey);
  if (world.empty() || !std::all_of(world.begin(), world.end(), ::isdigit) || world.size() > 9) return;
  for (int64_t shard = 1; shard <= std::stoll(world); ++shard) {
    DDP_CHECK(ranks.count(shard), "ddp: the checkpoint in '", dir, "' lacks every file of rank ", shard - 1, " of the ",
              world, " that wrote it (", fmt::format("shard-{:05d}-model-*.safetensors", shard),
              "): they were deleted or never written; load an older checkpoint");
  }
}

// Opens the checkpoint at `dir` for reading, every file accounted for.
std::unique_ptr<SafetensorsIndex> open_checkpoint(const std::string& dir) {
  const std::string source = committed_directory(dir);
  auto index = std::make_unique<SafetensorsIndex>(source);
  check_no_file_missing(source, *index);
  return index;
}

// An optimizer was given to load: the checkpoint must hold its state (its
// entries, or at least its hyperparameters when saved before any step).
void check_has_optimizer_state(const SafetensorsIndex& index, const Names& names, const std::string& dir) {
  DDP_CHECK(!index.keys_with_prefix(Names::join(names.options.optimizer_prefix(), "state.")).empty() ||
                !index.metadata(kParamGroupsKey).empty(),
            "ddp: the checkpoint in '", dir, "' holds no optimizer state under '", names.options.optimizer_prefix(),
            "'; load it without the optimizer, or set DistributedCheckpointOptions::optimizer_prefix");
}

DistributedCheckpointReport report_of(const SafetensorsIndex& index) {
  DistributedCheckpointReport report;
  report.bytes_read = index.bytes_read();
  report.checkpoint_bytes = index.data_bytes();
  return report;
}

// What rank 0 stores in its first file: the options' strings and the
// optimizer's hyperparameters.
std::map<std::string, std::string> rank0_metadata(const c10::IValue& optimizer,
                                                  const DistributedCheckpointOptions& options) {
  auto metadata = options.metadata();
  if (!optimizer.isNone()) metadata[kParamGroupsKey] = param_groups_json(optimizer).dump();
  return metadata;
}

// --- FSDP ---------------------------------------------------------------------

struct UnitLayout {
  std::vector<std::string> names;
  std::vector<int64_t> offsets;
  std::vector<std::vector<int64_t>> shapes;
  int64_t padded = 0;
  int64_t shard_start = 0;
  at::Tensor shard;
};

UnitLayout unit_layout(const c10::IValue& entry_value) {
  auto entry = entry_value.toGenericDict();
  DDP_CHECK(entry.contains("offsets"), "ddp: this FSDP sharded state dict has no layout; build it with this version");
  UnitLayout unit;
  for (const c10::IValue& n : entry.at("param_names").toList()) unit.names.push_back(n.toStringRef());
  unit.offsets = int_list(entry.at("offsets"));
  for (const c10::IValue& s : entry.at("shapes").toList()) unit.shapes.push_back(int_list(s));
  unit.padded = entry.at("padded").toInt();
  unit.shard_start = entry.at("shard_start").toInt();
  unit.shard = entry.at("shard").toTensor();
  return unit;
}

// The boxes of a unit's flat tensor `flat` (this rank's elements
// [held_start, held_start + flat.numel()) of the unit) that lie in
// [begin, end), per parameter, under `key_of(parameter)`.
template <typename KeyOf>
void add_unit_boxes(std::vector<TensorBox>& out, const UnitLayout& unit, const at::Tensor& flat, int64_t begin,
                    int64_t end, KeyOf key_of) {
  for (size_t j = 0; j < unit.names.size(); ++j) {
    const int64_t first = unit.offsets[j];
    const int64_t count = element_count(unit.shapes[j]);
    const int64_t from = std::max(begin, first), to = std::min(end, first + count);
    if (from >= to) continue;
    add_boxes(out, key_of(j), unit.shapes[j], flat, unit.shard_start - first, from - first, to - first);
  }
}

// The part of the unit this rank writes: under NO_SHARD (every rank holds
// the whole flat tensor) an equal part of it; else its shard, or under HSDP,
// where `replicas` ranks hold the same shard, this replica's equal part of it.
std::pair<int64_t, int64_t> written_range(const UnitLayout& unit, int rank, int world, int replica, int replicas) {
  const int64_t held = unit.shard.numel();
  if (held == unit.padded && world > 1) {
    const ShardRange part = balanced_part(unit.padded, world, rank);
    return {part.begin, part.end};
  }
  const ShardRange part = balanced_part(held, replicas, replica);
  return {unit.shard_start + part.begin, unit.shard_start + part.end};
}

}  // namespace

void save_fsdp_checkpoint(const std::string& dir, const c10::IValue& sharded, ProcessGroup& group,
                          const DistributedCheckpointOptions& options) {
  const Names names{options};
  auto dict = sharded.toGenericDict();
  const int rank = group.rank(), world = group.size();
  std::vector<TensorBox> boxes;
  c10::IValue optimizer = dict.contains("optimizer") ? dict.at("optimizer") : c10::IValue();
  std::optional<OptimizerStateParts> optim;
  if (!optimizer.isNone()) optim = parse_optimizer_state(optimizer, "save_distributed_checkpoint");
  const int replica = dict.contains("replica") ? static_cast<int>(dict.at("replica").toInt()) : 0;
  const int replicas = dict.contains("replicas") ? static_cast<int>(dict.at("replicas").toInt()) : 1;
  auto units = dict.at("units").toList();
  for (size_t u = 0; u < units.size(); ++u) {
    const UnitLayout unit = unit_layout(units.get(u));
    const auto [begin, end] = written_range(unit, rank, world, replica, replicas);
    add_unit_boxes(boxes, unit, unit.shard, begin, end, [&](size_t j) { return names.model(unit.names[j]); });
    if (!optim) continue;
    auto found = optim->state.find(static_cast<int64_t>(u));
    if (found == optim->state.end()) continue;  // not stepped yet
    for (const auto& item : found->value().toGenericDict()) {
      const std::string key = item.key().toStringRef();
      if (is_per_element_state(key)) {
        const at::Tensor flat = item.value().toTensor();
        add_unit_boxes(boxes, unit, flat, begin, end, [&](size_t j) { return names.optimizer(unit.names[j], key); });
      } else {
        // One value for the whole unit ("step"): written once per
        // parameter, by the rank that writes its first element.
        for (size_t j = 0; j < unit.names.size(); ++j) {
          if (unit.offsets[j] >= begin && unit.offsets[j] < end && element_count(unit.shapes[j]) > 0) {
            boxes.push_back(TensorBox{names.optimizer(unit.names[j], key), {}, item.value().toTensor().detach().clone()});
          }
        }
      }
    }
  }
  for (const auto& item : dict.at("buffers").toGenericDict()) {
    add_replicated(boxes, names.model(item.key().toStringRef()), item.value().toTensor(), rank, world);
  }
  commit_boxes(dir, boxes, rank == 0 ? rank0_metadata(optimizer, options) : std::map<std::string, std::string>{},
               group);
}

c10::IValue read_fsdp_checkpoint(const std::string& dir, const c10::IValue& sharded, bool with_optimizer,
                                 const DistributedCheckpointOptions& options, DistributedCheckpointReport* report) {
  const Names names{options};
  const auto opened = open_checkpoint(dir);
  const SafetensorsIndex& index = *opened;
  auto dict = sharded.toGenericDict().copy();
  auto units = dict.at("units").toList();
  std::vector<TensorBox> boxes;
  auto optim_state = new_generic_dict();
  std::vector<std::pair<int64_t, std::string>> steps;  // (unit, the key of its step)
  for (size_t u = 0; u < units.size(); ++u) {
    const UnitLayout unit = unit_layout(units.get(u));
    const int64_t begin = unit.shard_start, end = unit.shard_start + unit.shard.numel();
    for (size_t j = 0; j < unit.names.size(); ++j) check_shape(index, names.model(unit.names[j]), unit.shapes[j]);
    // The shard in the state dict is a copy: fill it, padding zeroed.
    unit.shard.zero_();
    add_unit_boxes(boxes, unit, unit.shard, begin, end, [&](size_t j) { return names.model(unit.names[j]); });
    if (!with_optimizer) continue;
    // The unit's optimizer entries are those its first parameter has; all
    // its parameters must have the same.
    std::vector<std::string> keys;
    for (const auto& key : index.keys_with_prefix(names.optimizer_entries(unit.names[0]))) {
      const std::string rest = key.substr(names.optimizer_entries(unit.names[0]).size());
      if (rest.find('.') == std::string::npos) keys.push_back(rest);
    }
    if (keys.empty()) continue;  // saved before the optimizer stepped
    auto entry = new_generic_dict();
    for (const auto& key : keys) {
      for (const auto& name : unit.names) {
        DDP_CHECK(index.contains(names.optimizer(name, key)), "ddp: the checkpoint has optimizer state '", key,
                  "' for '", unit.names[0], "' but not for '", name, "'; FSDP needs it for every parameter of a unit");
      }
      if (is_per_element_state(key)) {
        for (size_t j = 0; j < unit.names.size(); ++j) {
          check_shape(index, names.optimizer(unit.names[j], key), unit.shapes[j]);
        }
        at::Tensor flat = at::zeros_like(unit.shard);
        add_unit_boxes(boxes, unit, flat, begin, end, [&](size_t j) { return names.optimizer(unit.names[j], key); });
        entry.insert(key, flat);
      } else {
        at::Tensor value = at::zeros({}, at::kFloat);
        boxes.push_back(TensorBox{names.optimizer(unit.names[0], key), {}, value});
        entry.insert(key, value);
      }
    }
    optim_state.insert(static_cast<int64_t>(u), entry);
  }
  auto buffers = dict.at("buffers").toGenericDict();
  for (const auto& item : buffers) {
    const std::string key = names.model(item.key().toStringRef());
    at::Tensor target = item.value().toTensor();
    check_shape(index, key, target.sizes());
    boxes.push_back(TensorBox{key, std::vector<int64_t>(target.dim(), 0), target});
  }
  for (auto& box : boxes) index.read_into(box);

  if (with_optimizer) {
    check_has_optimizer_state(index, names, dir);
    DDP_CHECK(dict.contains("optimizer"), "ddp: load_distributed_checkpoint was given no optimizer state to fill");
    auto current = parse_optimizer_state(dict.at("optimizer"), "load_distributed_checkpoint");
    dict.insert_or_assign("optimizer",
                          make_optimizer_state(optim_state, restored_param_groups(current, index.metadata(kParamGroupsKey))));
  }
  if (report) *report = report_of(index);
  return dict;
}

// --- DDP and ZeRO ---------------------------------------------------------------

std::vector<int64_t> all_indices(const torch::nn::Module& module) {
  std::vector<int64_t> indices(module.named_parameters(true).size());
  for (size_t i = 0; i < indices.size(); ++i) indices[i] = static_cast<int64_t>(i);
  return indices;
}

c10::IValue optimizer_state_or_none(torch::optim::Optimizer* optimizer) {
  return optimizer ? optimizer_state_dict(*optimizer) : c10::IValue();
}

void load_optimizer_state_or_none(torch::optim::Optimizer* optimizer, const c10::IValue& state) {
  if (optimizer) load_optimizer_state_dict(*optimizer, state);
}

void save_replicated_checkpoint(const std::string& dir, const torch::nn::Module& module, const c10::IValue& optimizer,
                                const std::vector<int64_t>& owned, bool sharded_optimizer, ProcessGroup& group,
                                const DistributedCheckpointOptions& options) {
  const Names names{options};
  const int rank = group.rank(), world = group.size();
  std::vector<TensorBox> boxes;
  for (const auto& [name, tensor] : ddp::state_dict(module)) add_replicated(boxes, names.model(name), tensor, rank, world);
  if (!optimizer.isNone()) {
    const auto params = module.named_parameters(true);
    std::vector<std::string> fqns;
    for (int64_t i : owned) fqns.push_back(params[i].key());
    add_optimizer_state(boxes, optimizer, fqns, names.optimizer_entries_of(), sharded_optimizer, rank, world);
  }
  commit_boxes(dir, boxes, rank == 0 ? rank0_metadata(optimizer, options) : std::map<std::string, std::string>{},
               group);
}

c10::IValue load_replicated_checkpoint(const std::string& dir, torch::nn::Module& module, const c10::IValue& optimizer,
                                       const std::vector<int64_t>& owned, const DistributedCheckpointOptions& options,
                                       DistributedCheckpointReport* report) {
  const Names names{options};
  const auto opened = open_checkpoint(dir);
  const SafetensorsIndex& index = *opened;
  // Read into copies: the module changes only once everything has been read.
  std::vector<std::pair<at::Tensor, TensorBox>> model;
  for (const auto& [name, tensor] : ddp::state_dict(module)) {
    const std::string key = names.model(name);
    check_shape(index, key, tensor.sizes());
    model.emplace_back(tensor, TensorBox{key, std::vector<int64_t>(tensor.dim(), 0), at::empty_like(tensor)});
  }
  for (auto& [tensor, box] : model) index.read_into(box);

  c10::IValue result;
  if (!optimizer.isNone()) {
    check_has_optimizer_state(index, names, dir);
    const auto params = module.named_parameters(true);
    std::vector<std::pair<std::string, at::Tensor>> owned_params;
    for (int64_t i : owned) owned_params.emplace_back(params[i].key(), params[i].value());
    result = read_optimizer_state(index, optimizer, owned_params, names.optimizer_entries_of(),
                                  index.metadata(kParamGroupsKey));
  }
  at::NoGradGuard no_grad;
  for (auto& [tensor, box] : model) tensor.detach().copy_(box.data);
  if (report) *report = report_of(index);
  return result;
}

}  // namespace ddp::detail

namespace ddp {

std::map<std::string, std::string> distributed_checkpoint_metadata(const std::string& dir) {
  auto metadata = detail::open_checkpoint(dir)->all_metadata();
  // DCP's own entries and ddp's are not the program's.
  for (const char* own : {"DCP_VERSION", "format", detail::kParamGroupsKey, detail::kWorldSizeKey}) {
    metadata.erase(own);
  }
  return metadata;
}

namespace detail {

std::map<std::string, std::vector<int64_t>> checkpoint_shapes(const std::string& dir, const std::string& prefix) {
  const auto index = open_checkpoint(dir);
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& key : index->keys_with_prefix(prefix)) shapes.emplace(key, index->shape_of(key));
  return shapes;
}

}  // namespace detail

}  // namespace ddp

// --- DiLoCo ---------------------------------------------------------------------

namespace ddp {
namespace {

// The rank 0 metadata entry that makes a checkpoint a DiLoCo job's.
constexpr const char* kDiLoCoKey = "ddp_diloco";
constexpr int64_t kDiLoCoCheckpointVersion = 1;

// Where each part of a DiLoCo job lives in the checkpoint (see
// distributed_checkpoint.h).
struct DiLoCoNames {
  detail::Names names;

  std::string replica(int64_t r) const { return "diloco.replica_" + std::to_string(r) + "."; }
  std::string local(int64_t r, const std::string& fqn) const { return replica(r) + names.model(fqn); }
  detail::EntriesOf inner_entries(int64_t r) const {
    return [prefix = replica(r) + detail::Names::join(names.options.optimizer_prefix(), "state.")](
               const std::string& fqn) { return prefix + fqn + "."; };
  }
  static detail::EntriesOf outer_entries() {
    return [](const std::string& fqn) { return "diloco.outer.state." + fqn + "."; };
  }
  static std::string in_flight(int64_t fragment) { return "diloco.in_flight." + std::to_string(fragment); }
};

// Each of diloco's parameters' name in its module.
std::vector<std::string> parameter_names(DiLoCo& diloco, const char* who) {
  torch::nn::Module* module = diloco.module();
  DDP_CHECK(module != nullptr, "ddp: ", who, " needs the DiLoCo built over the module, DiLoCo(model, inner, group), ",
            "to name its tensors; this one was given a list of parameters");
  DDP_CHECK(diloco.process_group() != nullptr, "ddp: ", who, " needs a DiLoCo over a ProcessGroup; under ",
            "FaultTolerance a lost replica heals from a live one instead of a checkpoint");
  std::unordered_map<const void*, std::string> by_tensor;
  for (const auto& item : module->named_parameters(true)) by_tensor.emplace(item.value().unsafeGetTensorImpl(), item.key());
  std::vector<std::string> names;
  for (const auto& p : diloco.local_parameters()) {
    const auto found = by_tensor.find(p.unsafeGetTensorImpl());
    DDP_CHECK(found != by_tensor.end(), "ddp: ", who, ": a parameter DiLoCo steps is not the module's any more; ",
              "build DiLoCo over the module it trains");
    names.push_back(found->second);
  }
  return names;
}

void check_inner(DiLoCo& diloco, torch::optim::Optimizer* inner, const char* who) {
  DDP_CHECK(inner == nullptr || inner == &diloco.inner_optimizer(), "ddp: ", who,
            " was given an optimizer that is not the inner one this DiLoCo steps; pass that one, or nullptr");
}

detail::TensorBox whole_box(const std::string& key, const at::Tensor& tensor) {
  return detail::TensorBox{key, std::vector<int64_t>(tensor.dim(), 0), tensor.detach()};
}

// A box to read `key` into, shaped and typed like `like`, its shape checked.
detail::TensorBox box_like(const detail::SafetensorsIndex& index, const std::string& key, const at::Tensor& like) {
  detail::check_shape(index, key, like.sizes());
  at::Tensor data = at::empty_like(like.detach(), like.options().requires_grad(false));
  return detail::TensorBox{key, std::vector<int64_t>(data.dim(), 0), data};
}

}  // namespace

void save_distributed_checkpoint(const std::string& dir, DiLoCo& diloco, torch::optim::Optimizer* inner,
                                 const DistributedCheckpointOptions& options) {
  const char* who = "save_distributed_checkpoint(DiLoCo)";
  check_inner(diloco, inner, who);
  const std::vector<std::string> fqns = parameter_names(diloco, who);
  ProcessGroup& group = *diloco.process_group();
  const int rank = group.rank(), world = group.size();
  const DiLoCoNames n{detail::Names{options}};
  auto state = diloco.state_dict().toGenericDict();  // waits for the syncs in flight

  std::vector<detail::TensorBox> boxes;
  const auto global = state.at("global").toList();
  const auto& local = diloco.local_parameters();
  for (size_t i = 0; i < fqns.size(); ++i) {
    detail::add_replicated(boxes, n.names.model(fqns[i]), global.get(i).toTensor(), rank, world);
    boxes.push_back(whole_box(n.local(rank, fqns[i]), local[i]));
  }
  for (const auto& item : diloco.module()->named_buffers(true)) {
    if (rank == 0) boxes.push_back(whole_box(n.names.model(item.key()), item.value()));
    boxes.push_back(whole_box(n.local(rank, item.key()), item.value()));
  }
  const c10::IValue inner_state = detail::optimizer_state_or_none(inner);
  if (inner) detail::add_optimizer_state(boxes, inner_state, fqns, n.inner_entries(rank), true, rank, world);
  const c10::IValue outer = state.at("outer_optimizer");
  detail::add_optimizer_state(boxes, outer, fqns, DiLoCoNames::outer_entries(), false, rank, world);
  detail::Json flights = detail::Json::array();
  for (const c10::IValue& item : state.at("in_flight").toList()) {
    const auto flight = item.toGenericDict();
    const int64_t fragment = flight.at("fragment").toInt();
    detail::add_replicated(boxes, DiLoCoNames::in_flight(fragment), flight.at("sum").toTensor(), rank, world);
    flights.push_back({{"fragment", fragment}, {"due", flight.at("due").toInt()}});
  }

  std::map<std::string, std::string> metadata;
  if (rank == 0) {
    metadata = detail::rank0_metadata(inner_state, options);
    metadata[kDiLoCoKey] = detail::Json{{"version", kDiLoCoCheckpointVersion},
                                        {"replicas", world},
                                        {"inner_step", state.at("inner_step").toInt()},
                                        {"syncs_started", state.at("syncs_started").toInt()},
                                        {"outer_param_groups", detail::param_groups_json(outer)},
                                        {"in_flight", flights}}
                               .dump();
  }
  detail::commit_boxes(dir, boxes, metadata, group);
}

DistributedCheckpointReport load_distributed_checkpoint(const std::string& dir, DiLoCo& diloco,
                                                        torch::optim::Optimizer* inner,
                                                        const DistributedCheckpointOptions& options) {
  const char* who = "load_distributed_checkpoint(DiLoCo)";
  check_inner(diloco, inner, who);
  const std::vector<std::string> fqns = parameter_names(diloco, who);
  ProcessGroup& group = *diloco.process_group();
  const DiLoCoNames n{detail::Names{options}};
  const auto opened = detail::open_checkpoint(dir);
  const detail::SafetensorsIndex& index = *opened;
  const std::string saved = index.metadata(kDiLoCoKey);
  DDP_CHECK(!saved.empty(), "ddp: the checkpoint in '", dir, "' was not saved from a DiLoCo job (its metadata has no ",
            kDiLoCoKey, "); load it as the model it was saved from, or save this job with ",
            "save_distributed_checkpoint(dir, diloco, &inner)");
  const detail::Json meta = detail::Json::parse(saved, nullptr, false);
  DDP_CHECK(meta.is_object() && meta.value("version", int64_t{0}) == kDiLoCoCheckpointVersion &&
                meta.value("replicas", int64_t{0}) >= 1 && meta.contains("in_flight") && meta["in_flight"].is_array(),
            "ddp: the checkpoint in '", dir, "' has a DiLoCo entry this build cannot read (version ",
            meta.is_object() ? meta.value("version", int64_t{0}) : 0, ", this build reads ", kDiLoCoCheckpointVersion,
            "); save it again with this build");
  const int64_t source = group.rank() % meta["replicas"].get<int64_t>();

  // Everything is read into copies first: the job changes only once all of it has been read.
  std::vector<std::pair<at::Tensor, detail::TensorBox>> local;
  const auto& params = diloco.local_parameters();
  for (size_t i = 0; i < fqns.size(); ++i) local.emplace_back(params[i], box_like(index, n.local(source, fqns[i]), params[i]));
  for (const auto& item : diloco.module()->named_buffers(true)) {
    local.emplace_back(item.value(), box_like(index, n.local(source, item.key()), item.value()));
  }
  for (auto& [tensor, box] : local) index.read_into(box);

  c10::impl::GenericList global(c10::AnyType::get());
  std::vector<std::pair<std::string, at::Tensor>> named_global, named_local;
  for (size_t i = 0; i < fqns.size(); ++i) {
    const at::Tensor& g = diloco.global_parameters()[i];
    auto box = box_like(index, n.names.model(fqns[i]), g);
    index.read_into(box);
    global.push_back(box.data);
    named_global.emplace_back(fqns[i], g);
    named_local.emplace_back(fqns[i], params[i]);
  }
  const c10::IValue outer =
      detail::read_optimizer_state(index, optimizer_state_dict(diloco.outer_optimizer()), named_global,
                                   DiLoCoNames::outer_entries(), meta.value("outer_param_groups", detail::Json::array()).dump());
  c10::impl::GenericList flights(c10::AnyType::get());
  for (const auto& flight : meta["in_flight"]) {
    const int64_t fragment = flight.value("fragment", int64_t{-1});
    const std::string key = DiLoCoNames::in_flight(fragment);
    DDP_CHECK(index.contains(key), "ddp: the checkpoint in '", dir, "' names a sync of fragment ", fragment,
              " in flight but holds no '", key, "'; it is damaged: load an earlier one");
    at::Tensor sum = at::empty(index.shape_of(key), at::kFloat);  // the summed pseudo-gradient is fp32
    detail::TensorBox box{key, std::vector<int64_t>(sum.dim(), 0), sum};
    index.read_into(box);
    auto entry = detail::new_generic_dict();
    entry.insert("fragment", fragment);
    entry.insert("due", flight.value("due", int64_t{0}));
    entry.insert("sum", sum);
    flights.push_back(entry);
  }
  c10::IValue inner_state;
  if (inner) {
    inner_state = detail::read_optimizer_state(index, optimizer_state_dict(*inner), named_local, n.inner_entries(source),
                                               index.metadata(detail::kParamGroupsKey));
  }

  auto state = diloco.state_dict().toGenericDict().copy();  // this build's layout and version
  state.insert_or_assign("inner_step", meta.value("inner_step", int64_t{0}));
  state.insert_or_assign("syncs_started", meta.value("syncs_started", int64_t{0}));
  state.insert_or_assign("global", global);
  state.insert_or_assign("outer_optimizer", outer);
  state.insert_or_assign("in_flight", flights);
  {
    at::NoGradGuard no_grad;
    for (auto& [tensor, box] : local) tensor.detach().copy_(box.data);
  }
  if (inner) load_optimizer_state_dict(*inner, inner_state);
  diloco.load_state_dict(state);
  return detail::report_of(index);
}

}  // namespace ddp
