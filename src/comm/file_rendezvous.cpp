// The file:// rendezvous. The ranks meet in a c10d FileStore, an append-only
// file of (key, value) records that every process reads and writes under
// flock(2). A file has no host that could tell a new job from an old one, so
// the meeting itself must notice a file that an earlier run left behind:
//
//  - every rank counts itself in its own slot, claim_<rank>: a count above 1
//    means a process with this rank joined here before (an earlier run, or a
//    second process of this job with the same RANK);
//  - rank 0 then writes a record with a nonce of its own; the other ranks
//    read it, check its world size and run id, and file their records under
//    that nonce, so rank 0 never mistakes a record an old run left for a rank
//    of this job;
//  - a rank that finds the file stale writes why under "stop" and fails; the
//    others read it while they wait, and fail with the same message.
//
// If an earlier run left anything in its slots, some rank of the new job
// finds a claim above 1: either an old rank 0 opened the file (the new rank
// 0's claim is 2), or none did (the old ranks that joined are waiting for an
// opening that never came, and each of their slots is claimed twice now). So
// every rank of the job fails, each when it next looks, and none proceeds.

#include "comm/file_rendezvous.h"

#include "common/duration_text.h"
#include "common/error_text.h"
#include "comm/rendezvous.h"

#include <ddp/error.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <vector>

namespace ddp::detail {
namespace {

using Clock = std::chrono::steady_clock;

// How a message ends that asks for another path.
constexpr const char* kUsePath =
    "use a path (init_method file:///..., or DDP_INIT_METHOD) in a directory that every rank can write, on a "
    "file system they all share";

std::string directory_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == 0 ? std::string("/") : path.substr(0, slash);
}

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0 || name[0] == '\0') return "?";
  return name;
}

// How far a walk over a FileStore file's records got.
struct RecordWalk {
  off_t end = 0;        // where the last whole (key, value) record ends
  bool whole = true;    // whether the records run to the file's end
  uint64_t claimed = 0; // when not whole: the length the first bad field claims
};

// Walks c10d FileStore records, (length, key, length, value) with 32-bit
// lengths, from `from` to `size`, reading only the lengths: memory and time
// stay bounded by the number of records whatever the lengths say. c10d itself
// allocates whatever a length claims, and spins on a read past the end.
RecordWalk walk_records(int fd, off_t from, off_t size) {
  RecordWalk walk;
  walk.end = from;
  off_t at = from;
  int field = 0;
  while (at < size) {
    uint32_t length = 0;
    ssize_t got;
    do {
      got = ::pread(fd, &length, sizeof(length), at);
    } while (got < 0 && errno == EINTR);
    if (got != static_cast<ssize_t>(sizeof(length)) || static_cast<uint64_t>(size - at) - sizeof(length) < length) {
      walk.whole = false;
      walk.claimed = got == static_cast<ssize_t>(sizeof(length)) ? length : 0;
      return walk;
    }
    at += static_cast<off_t>(sizeof(length) + length);
    if (++field % 2 == 0) walk.end = at;
  }
  walk.whole = field % 2 == 0;
  return walk;
}

int lock_shared(int fd) {
  int rc;
  do {
    rc = ::flock(fd, LOCK_SH);
  } while (rc != 0 && errno == EINTR);
  return rc;
}

// Checks what c10d would otherwise report late or never: a missing or
// unwritable directory (c10d waits for a missing one until its timeout), a
// path that is not a regular file, a file that is not a store's. Returns
// the file's identity and how far its records were checked.
struct FileIdentity {
  dev_t device = 0;
  ino_t inode = 0;
  off_t checked = 0;
};

FileIdentity check_usable(const std::string& path, int rank) {
  const std::string where = c10::str("ddp: rank ", rank, " cannot use the rendezvous file ", path);
  const std::string directory = directory_of(path);
  struct stat info {};
  if (::stat(directory.c_str(), &info) != 0) {
    const int error = errno;
    const std::string why = error == ENOENT ? std::string("does not exist")
                                            : "cannot be reached (" + std::string(std::strerror(error)) + ")";
    DDP_CHECK(false, where, ": its directory ", directory, " ", why, ". Create it, or ", kUsePath, ".");
  }
  DDP_CHECK(S_ISDIR(info.st_mode), where, ": ", directory, " is not a directory; ", kUsePath, ".");
  if (::stat(path.c_str(), &info) == 0) {
    DDP_CHECK(S_ISREG(info.st_mode), where, ": it exists and is not a regular file; ", kUsePath, ".");
  }
  // As c10d opens it: created if missing, read and written.
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int error = errno;
    DDP_CHECK(false, where, ": it cannot be created or written (", std::strerror(error), "). Every rank writes it: ",
              kUsePath, ".");
  }
  // Under a shared lock: c10d writes under an exclusive one, so a record is
  // never seen half-written.
  FileIdentity identity;
  RecordWalk walk;
  int error = 0;
  if (lock_shared(fd) != 0 || ::fstat(fd, &info) != 0) {
    error = errno;
  } else {
    identity.device = info.st_dev;
    identity.inode = info.st_ino;
    walk = walk_records(fd, 0, info.st_size);
    identity.checked = walk.end;
  }
  ::close(fd);
  DDP_CHECK(error == 0, where, ": it cannot be read (", std::strerror(error), "); ", kUsePath, ".");
  DDP_CHECK(walk.whole, where, ": it holds ", info.st_size,
            " bytes that are not a c10d store's records, so it is some other file. Delete it if it is not needed, or ",
            kUsePath, ".");
  return identity;
}

// Watches the file between c10d's reads of it, which trust it entirely: bytes
// that are not records (c10d would allocate what they claim and spin reading
// past the end), a file deleted or replaced (c10d silently makes a new empty
// one and waits for records that are gone until its timeout). Each rank
// notices on its own at its next store operation, so none waits for another
// to say so through a file that can no longer carry it.
class StoreFileWatch {
 public:
  StoreFileWatch(std::string path, int rank, FileIdentity identity)
      : path_(std::move(path)), rank_(rank), identity_(identity) {}

  // Throws a ddp::Error naming what happened to the file.
  void check() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failure_.empty()) DDP_CHECK(false, failure_);
    const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      const int error = errno;
      if (error == ENOENT) {
        fail(c10::str("ddp: the rendezvous file ", path_, " was deleted while rank ", rank_,
                      " used it: the records through which the ranks meet are gone (c10d would make a new, empty ",
                      "file and wait for them until its timeout). Something other than this job removed it; keep ",
                      "the file until every rank has shut its process group down, then start the job again."));
      }
      return;  // c10d reports other errors itself, with its own timeout
    }
    struct stat info {};
    std::string failure;
    if (lock_shared(fd) != 0 || ::fstat(fd, &info) != 0) {
      ::close(fd);
      return;
    }
    if (info.st_dev != identity_.device || info.st_ino != identity_.inode) {
      failure = c10::str("ddp: the rendezvous file ", path_, " was replaced while rank ", rank_,
                         " used it: the file there now is another one (deleted and created again), without the ",
                         "records through which the ranks met. Something other than this job removed it; keep the ",
                         "file until every rank has shut its process group down, then start the job again.");
    } else if (info.st_size < identity_.checked) {
      failure = c10::str("ddp: the rendezvous file ", path_, " shrank from ", identity_.checked, " to ",
                         info.st_size, " bytes while rank ", rank_,
                         " used it: records through which the ranks meet were cut off. Something other than this "
                         "job wrote to it; keep the file as it is until every rank has shut its process group down, ",
                         "then start the job again.");
    } else {
      const RecordWalk walk = walk_records(fd, identity_.checked, info.st_size);
      if (walk.whole) {
        identity_.checked = walk.end;
      } else {
        failure = c10::str("ddp: the rendezvous file ", path_, " holds ", info.st_size - walk.end,
                           " bytes from byte ", walk.end, " on that are not a c10d store's records",
                           walk.claimed ? c10::str(" (they claim a field of ", walk.claimed, " bytes)") : "",
                           ": something other than this job's ranks wrote into it while rank ", rank_,
                           " used it. Every rank stops rather than read them. Delete the file and start the job ",
                           "again, with a path that no other program writes (init_method file:///..., or ",
                           "DDP_INIT_METHOD).");
      }
    }
    ::close(fd);
    if (!failure.empty()) fail(failure);
  }

  // Whether `info` (an fstat of an open descriptor) is the file this job met in.
  bool is_the_file(const struct stat& info) {
    std::lock_guard<std::mutex> lock(mutex_);
    return info.st_dev == identity_.device && info.st_ino == identity_.inode;
  }

  int rank() const { return rank_; }

  // Whether check() found the file unusable: nothing may read it then.
  bool failed() {
    std::lock_guard<std::mutex> lock(mutex_);
    return !failure_.empty();
  }

 private:
  [[noreturn]] void fail(const std::string& message) {
    failure_ = message;
    DDP_CHECK(false, message);
  }

  const std::string path_;
  const int rank_;
  std::mutex mutex_;
  FileIdentity identity_;
  std::string failure_;  // once unusable, always: the first verdict is the one to repeat
};

// A store in a c10d FileStore's file, in its format, so that c10d's own
// FileStore (a Python rank's, say) can share the file: records of (length,
// key, length, value) with 32-bit lengths, appended under an exclusive
// flock(2) and read under a shared one; "/" before a user's key, "-" before a
// deleted one, "refcount/" and "cleanup/" counting the stores open on it.
//
// Why not c10d's FileStore itself: it trusts every byte. Checking the file
// first (StoreFileWatch) and then letting c10d read is two steps, and bytes
// appended in between reached c10d, which allocated the length they claimed
// and spun reading past the end. Here the records are read only up to the
// size seen under the lock, and a length that runs past it is refused before
// anything is allocated.
class CheckedFileStore : public c10d::Store {
 public:
  CheckedFileStore(std::string path, int world_size, std::shared_ptr<StoreFileWatch> watch)
      : path_(std::move(path)), world_size_(world_size), watch_(std::move(watch)) {
    add_record(kRefCountKey, 1);
  }

  ~CheckedFileStore() override {
    // As c10d's: the last store of the job to go removes the file. Past a
    // failed check nothing of it is read, and a file that is no longer the
    // one this job met in is never removed.
    if (watch_->failed()) return;
    try {
      const int64_t finished = add_record(kCleanupKey, 1);
      bool last = false;
      with_file(LOCK_EX, [&](int fd, off_t size) {
        refresh(fd, size);
        const int64_t references = counter(kRefCountKey) - 1;
        append(fd, kRefCountKey, std::to_string(references));
        last = references == 0 && world_size_ >= 0 && finished >= world_size_;
        if (last) ::unlink(path_.c_str());  // still under the lock, on the file checked to be ours
      });
    } catch (const std::exception&) {
      // Best effort, as c10d's: a store that cannot be read is left as it is.
    }
  }

  c10::intrusive_ptr<c10d::Store> clone() override {
    auto copy = c10::make_intrusive<CheckedFileStore>(path_, world_size_, watch_);
    copy->setTimeout(timeout_);
    return copy;
  }

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    with_file(LOCK_EX, [&](int fd, off_t) { append(fd, kUserPrefix + key, value); });
  }

  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override {
    std::vector<uint8_t> result;
    with_file(LOCK_EX, [&](int fd, off_t size) {
      refresh(fd, size);
      const auto found = cache_.find(kUserPrefix + key);
      if (found == cache_.end() ? expected.empty() : found->second == expected) {
        append(fd, kUserPrefix + key, desired);
        result = desired;
      } else {
        result = found == cache_.end() ? expected : found->second;
      }
    });
    return result;
  }

  std::vector<uint8_t> get(const std::string& key) override {
    const auto start = Clock::now();
    while (true) {
      std::optional<std::vector<uint8_t>> value;
      with_file(LOCK_SH, [&](int fd, off_t size) {
        refresh(fd, size);
        const auto found = cache_.find(kUserPrefix + key);
        if (found != cache_.end()) value = found->second;
      });
      if (value) return std::move(*value);
      TORCH_CHECK(timeout_ == kNoTimeout || Clock::now() - start <= timeout_, "Timeout waiting for key: ", key,
                  " after ", timeout_.count(), " ms");
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

  int64_t add(const std::string& key, int64_t value) override { return add_record(kUserPrefix + key, value); }

  bool deleteKey(const std::string& key) override {
    with_file(LOCK_EX, [&](int fd, off_t) { append(fd, kDeletePrefix + kUserPrefix + key, std::string()); });
    return true;  // as c10d's: the record is written whether or not the key was there
  }

  bool check(const std::vector<std::string>& keys) override {
    bool all = true;
    with_file(LOCK_SH, [&](int fd, off_t size) {
      refresh(fd, size);
      for (const auto& key : keys) all = all && cache_.count(kUserPrefix + key) != 0;
    });
    return all;
  }

  int64_t getNumKeys() override {
    int64_t count = 0;
    with_file(LOCK_SH, [&](int fd, off_t size) {
      refresh(fd, size);
      count = static_cast<int64_t>(cache_.size());  // c10d counts its own counters too
    });
    return count;
  }

  std::vector<std::string> listKeys() override {
    std::vector<std::string> keys;
    with_file(LOCK_SH, [&](int fd, off_t size) {
      refresh(fd, size);
      for (const auto& entry : cache_) {
        if (entry.first.rfind(kUserPrefix, 0) == 0) keys.push_back(entry.first.substr(kUserPrefix.size()));
      }
    });
    return keys;
  }

  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    const auto start = Clock::now();
    while (!check(keys)) {
      TORCH_CHECK(timeout == kNoTimeout || Clock::now() - start <= timeout, "Timeout waiting for key: ",
                  keys.empty() ? std::string() : keys.front(), " after ", timeout.count(), " ms");
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

 private:
  static inline const std::string kUserPrefix = "/";
  static inline const std::string kDeletePrefix = "-";
  static inline const std::string kRefCountKey = "refcount/";
  static inline const std::string kCleanupKey = "cleanup/";

  // Runs `use` on the file, locked (LOCK_SH or LOCK_EX) and checked: the
  // same file this job met in, grown only by whole records.
  template <typename Use>
  void with_file(int lock_kind, Use&& use) {
    watch_->check();
    std::lock_guard<std::mutex> lock(mutex_);
    const int fd = ::open(path_.c_str(), (lock_kind == LOCK_EX ? O_RDWR : O_RDONLY) | O_CLOEXEC);
    if (fd < 0) {
      const int error = errno;
      watch_->check();  // names a deleted file
      throw std::system_error(error, std::system_category(), "open(" + path_ + ")");
    }
    struct FdCloser {
      int fd;
      ~FdCloser() { ::close(fd); }  // drops the flock too
    } closer{fd};
    int rc;
    do {
      rc = ::flock(fd, lock_kind);
    } while (rc != 0 && errno == EINTR);
    struct stat info {};
    if (rc != 0 || ::fstat(fd, &info) != 0) throw std::system_error(errno, std::system_category(), "flock/fstat");
    // Replaced or cut since the check above: the check now says how.
    if (!watch_->is_the_file(info) || info.st_size < position_) {
      watch_->check();
      DDP_CHECK(false, "ddp: the rendezvous file ", path_, " changed under rank ", watch_->rank(),
                " while it read it; delete it and start the job again.");
    }
    use(fd, info.st_size);
  }

  // Reads the records appended since the last read, up to `size`, each
  // length checked against what is left before anything is allocated.
  void refresh(int fd, off_t size) {
    off_t at = position_;
    std::string key;
    std::vector<uint8_t> value;
    while (at < size) {
      if (!read_field(fd, at, size, key) || !read_field(fd, at, size, value)) {
        watch_->check();  // names the bytes that are not records
        DDP_CHECK(false, "ddp: the rendezvous file ", path_, " holds bytes from byte ", position_,
                  " on that are not a c10d store's records; delete it and start the job again.");
      }
      if (key.rfind(kDeletePrefix, 0) == 0) {
        cache_.erase(key.substr(kDeletePrefix.size()));
      } else {
        cache_[key] = std::move(value);
      }
      position_ = at;
    }
  }

  template <typename Bytes>
  static bool read_field(int fd, off_t& at, off_t size, Bytes& into) {
    uint32_t length = 0;
    if (size - at < static_cast<off_t>(sizeof length) || !read_exactly(fd, &length, sizeof length, at)) return false;
    if (static_cast<uint64_t>(size - at) - sizeof length < length) return false;
    into.resize(length);
    if (length > 0 && !read_exactly(fd, into.data(), length, at + static_cast<off_t>(sizeof length))) return false;
    at += static_cast<off_t>(sizeof length + length);
    return true;
  }

  static bool read_exactly(int fd, void* buffer, size_t count, off_t at) {
    auto* bytes = static_cast<uint8_t*>(buffer);
    while (count > 0) {
      const ssize_t got = ::pread(fd, bytes, count, at);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) return false;  // never spin on an end that moved
      bytes += got;
      count -= static_cast<size_t>(got);
      at += got;
    }
    return true;
  }

  // One record, in one write at the end, under the exclusive lock.
  template <typename Bytes>
  static void append(int fd, const std::string& key, const Bytes& value) {
    std::string record;
    const auto put = [&record](const void* data, uint32_t length) {
      record.append(reinterpret_cast<const char*>(&length), sizeof length);
      record.append(static_cast<const char*>(data), length);
    };
    put(key.data(), static_cast<uint32_t>(key.size()));
    put(value.data(), static_cast<uint32_t>(value.size()));
    off_t at = ::lseek(fd, 0, SEEK_END);
    if (at < 0) throw std::system_error(errno, std::system_category(), "lseek");
    size_t done = 0;
    while (done < record.size()) {
      const ssize_t wrote = ::pwrite(fd, record.data() + done, record.size() - done, at + static_cast<off_t>(done));
      if (wrote < 0 && errno == EINTR) continue;
      if (wrote < 0) throw std::system_error(errno, std::system_category(), "write");
      done += static_cast<size_t>(wrote);
    }
  }

  int64_t counter(const std::string& key) const {
    const auto found = cache_.find(key);
    if (found == cache_.end() || found->second.empty()) return 0;
    return std::stoll(std::string(found->second.begin(), found->second.end()));
  }

  int64_t add_record(const std::string& key, int64_t value) {
    int64_t total = 0;
    with_file(LOCK_EX, [&](int fd, off_t size) {
      refresh(fd, size);
      total = counter(key) + value;
      append(fd, key, std::to_string(total));
    });
    return total;
  }

  const std::string path_;
  const int world_size_;
  std::shared_ptr<StoreFileWatch> watch_;
  std::mutex mutex_;  // one operation at a time on this object's cache
  off_t position_ = 0;
  std::unordered_map<std::string, std::vector<uint8_t>> cache_;
};

// 64 random bits as hex: tells this meeting's records from any that an
// earlier run left in the file.
std::string make_nonce() {
  std::random_device device;
  uint64_t value = (static_cast<uint64_t>(device()) << 32) ^ device();
  value ^= static_cast<uint64_t>(::getpid()) << 20;
  value ^= static_cast<uint64_t>(Clock::now().time_since_epoch().count());
  std::ostringstream text;
  text << std::hex << value;
  return text.str();
}

// What a rank files when it joins; rank 0's also carries the nonce.
struct Record : RankRecord {
  std::string nonce;

  std::string encode() const { return nonce + "\n" + RankRecord::encode(); }
  static Record decode(const std::string& text) {
    Record r;
    std::istringstream in(text);
    std::getline(in, r.nonce);
    static_cast<RankRecord&>(r) = RankRecord::read(in);
    return r;
  }
};

// The meeting in the file (see the top of this file), under one deadline.
class FileMeeting {
 public:
  FileMeeting(c10d::Store& store, const World& world, std::string path, std::string run_id,
              Clock::time_point deadline, std::chrono::milliseconds timeout)
      : store_(store), world_(world), path_(std::move(path)), run_id_(std::move(run_id)), deadline_(deadline),
        timeout_(timeout) {
    me_.world_size = world.world_size;
    me_.run_id = run_id_;
    me_.host = host_name();
    me_.pid = std::to_string(::getpid());
  }

  // Returns the nonce under which this job's keys live.
  std::string run() {
    check_stop(/*on_arrival=*/true);
    const int64_t claims = store_.add(claim_key(world_.rank), 1);
    if (claims > 1) stop(claimed_before(claims), /*peer_failure=*/false);
    if (world_.rank == 0) {
      me_.nonce = make_nonce();
      store_.set(kOpened, bytes_of(me_.encode()));
      gather_everyone();
      store_.set(me_.nonce + "/complete", bytes_of("1"));
    } else {
      const Record opener = wait_for_opening();
      if (opener.world_size != world_.world_size || opener.run_id != run_id_) {
        stop(other_job(opener), /*peer_failure=*/false);
      }
      me_.nonce = opener.nonce;
      store_.set(rank_key(world_.rank), bytes_of(me_.encode()));
      wait_for_everyone();
    }
    return me_.nonce;
  }

 private:
  static constexpr const char* kStop = "stop";
  static constexpr const char* kOpened = "opened";
  static std::string claim_key(int r) { return "claim_" + std::to_string(r); }
  std::string rank_key(int r) const { return me_.nonce + "/rank_" + std::to_string(r); }

  std::string delete_it() const {
    return c10::str("Delete it (rm ", path_, ") or give this job a new path (init_method file:///..., or ",
                    "DDP_INIT_METHOD), then start the job again.");
  }

  std::string claimed_before(int64_t claims) const {
    return c10::str("ddp: the rendezvous file ", path_, " is stale: rank ", world_.rank, " (", me_.where(),
                    ") found that another process had joined there as rank ", world_.rank, " before it (", claims - 1,
                    " time(s)). The file was left by an earlier run that crashed or did not shut its process group ",
                    "down, or another job is using it. ", delete_it(),
                    " (If no earlier run used this file: two processes of this job were started with RANK=",
                    world_.rank, ".)");
  }

  std::string other_job(const Record& opener) const {
    return c10::str("ddp: the rendezvous file ", path_, " was opened by a rank 0 (", opener.where(), ") of run '",
                    opener.run_id, "' with world size ", opener.world_size, ", but rank ", world_.rank, " (",
                    me_.where(), ") belongs to run '", run_id_, "' with world size ", world_.world_size,
                    ": the file is stale, left by another job. ", delete_it(),
                    " (If every rank of this job was started just now, they disagree on WORLD_SIZE or the run id ",
                    "(DDP_RUN_ID); start them alike.)");
  }

  std::string not_all_joined(const std::vector<int>& arrived, const std::vector<int>& missing) const {
    return c10::str("ddp: rank ", world_.rank, " waited ", seconds_text(timeout_), " in the rendezvous file ", path_,
                    " for the other ", world_.world_size - 1, " rank(s), but not all of them joined: rank(s) ",
                    rank_list(arrived), " arrived, rank(s) ", rank_list(missing),
                    " did not. Check that every rank was started with the same init method (DDP_INIT_METHOD) and ",
                    "WORLD_SIZE=", world_.world_size, ", that the file's directory is the same shared file ",
                    "system on every node, and whether a missing rank failed before it got here. The file now ",
                    "holds this attempt's records: delete it before the next start.");
  }

  // Writes why the meeting stops, for the other ranks, and throws it.
  [[noreturn]] void stop(const std::string& message, bool peer_failure) {
    try {
      if (!store_.check({kStop})) store_.set(kStop, bytes_of(message));
    } catch (const std::exception&) {
      // The others then fail at their own deadline.
    }
    if (peer_failure) throw PeerFailure(message);
    DDP_CHECK(false, message);
  }

  // Throws the message of a rank that stopped the meeting. One found on
  // arrival was left by an earlier run: the file is stale for this rank too.
  void check_stop(bool on_arrival) {
    if (!store_.check({kStop})) return;
    const std::string message = text_of(store_.get(kStop));
    if (on_arrival) {
      // Usually a stale file's own message, from a rank of this job that came
      // first or of an earlier start; the file is stale for this rank too.
      const bool says_stale = message.find(path_ + " is stale") != std::string::npos;
      DDP_CHECK(!says_stale, message, " (rank ", world_.rank, " found this in the file when it arrived)");
      DDP_CHECK(false, "ddp: the rendezvous file ", path_, " is stale: a rendezvous there had already stopped ",
                "when rank ", world_.rank, " arrived, because: ", message, " ", delete_it());
    }
    DDP_PEER_CHECK(false, message, " (rank ", world_.rank, " stops too)");
  }

  void sleep_a_little() {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - Clock::now());
    std::this_thread::sleep_for(std::clamp(left, std::chrono::milliseconds(1), std::chrono::milliseconds(20)));
  }

  void gather_everyone() {
    wait_for_every_rank(
        world_.world_size, deadline_, [&](int r) { return store_.check({rank_key(r)}); },
        [&] { check_stop(/*on_arrival=*/false); }, [&] { sleep_a_little(); },
        [&](const std::vector<int>& arrived, const std::vector<int>& missing) {
          stop(not_all_joined(arrived, missing), /*peer_failure=*/true);
        });
  }

  Record wait_for_opening() {
    while (!store_.check({kOpened})) {
      check_stop(/*on_arrival=*/false);
      DDP_PEER_CHECK(Clock::now() < deadline_, "ddp: rank ", world_.rank, " waited ", seconds_text(timeout_),
                     " in the rendezvous file ", path_, " for rank 0 to open it, but it did not. Check that rank 0 ",
                     "of this job is running with the same init method (DDP_INIT_METHOD), and that the file's ",
                     "directory is the same shared file system on every node.");
      sleep_a_little();
    }
    return Record::decode(text_of(store_.get(kOpened)));
  }

  void wait_for_everyone() {
    while (!store_.check({me_.nonce + "/complete"})) {
      check_stop(/*on_arrival=*/false);
      if (Clock::now() >= deadline_) {
        std::vector<int> arrived{0}, missing;
        try {
          for (int r = 1; r < world_.world_size; ++r) (store_.check({rank_key(r)}) ? arrived : missing).push_back(r);
        } catch (const std::exception&) {
          // Report what is known.
        }
        DDP_PEER_CHECK(false, not_all_joined(arrived, missing));
      }
      sleep_a_little();
    }
  }

  c10d::Store& store_;
  const World& world_;
  const std::string path_;
  const std::string run_id_;
  const Clock::time_point deadline_;
  const std::chrono::milliseconds timeout_;
  Record me_;
};

}  // namespace

c10::intrusive_ptr<c10d::Store> file_rendezvous(const World& world, const std::string& path,
                                                const std::string& run_id, std::chrono::milliseconds timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  auto watch = std::make_shared<StoreFileWatch>(path, world.rank, check_usable(path, world.rank));
  c10::intrusive_ptr<CheckedFileStore> file;
  try {
    try {
      // With the world size, c10d removes the file when the last FileStore
      // on it is destroyed, once at least that many were.
      file = c10::make_intrusive<CheckedFileStore>(path, world.world_size, watch);
      file->setTimeout(remaining(deadline));
      // The attempt's prefix keeps a restarted job (ddprun/torchrun
      // --max-restarts) apart from its failed attempts in the same file.
      const std::string attempt = "ddp/attempt_" + std::to_string(restart_count());
      auto meeting_store = c10::make_intrusive<c10d::PrefixStore>(attempt + "/file_rdzv", file);
      const std::string nonce = FileMeeting(*meeting_store, world, path, run_id, deadline, timeout).run();
      file->setTimeout(timeout);  // later uses of the store get the full timeout each
      return c10::make_intrusive<c10d::PrefixStore>(attempt + "/job_" + nonce, file);
    } catch (...) {
      // A failed start leaves the file as it is. Destroying this FileStore
      // would count this rank out, and c10d could then remove the file: a
      // stale one the message asks the user to look at, or one where a rank
      // of this job has yet to read why the meeting stopped (it would make a
      // fresh file and wait out its timeout). So this one object is never
      // destroyed; c10d holds no descriptor open between operations.
      if (file) (void)c10::intrusive_ptr<CheckedFileStore>(file).release();
      throw;
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    // c10d's own errors: a system_error from open/flock/read, a key timeout.
    const std::string cause = message_of(e);
    DDP_CHECK(false, "ddp: rank ", world.rank, " cannot use the rendezvous file ", path, ": ", cause,
              ". Check that every rank can read and write it, or ", kUsePath, ".");
  }
}

}  // namespace ddp::detail
