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

#include <torch/csrc/distributed/c10d/FileStore.hpp>
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
#include <random>
#include <sstream>
#include <system_error>
#include <thread>
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

// c10d's FileStore with the file checked (StoreFileWatch) before each of its
// operations, for the rendezvous and for the rest of the job. A check and
// c10d's read are two steps: bytes appended in between still reach c10d.
class CheckedFileStore : public c10d::FileStore {
 public:
  CheckedFileStore(const std::string& path, int world_size, std::shared_ptr<StoreFileWatch> watch)
      : c10d::FileStore(checked_first(path, *watch), world_size), watch_(std::move(watch)) {}

  ~CheckedFileStore() override {
    // c10d's destructor counts this rank out in the file, and removes it
    // when no path is there: past a failed check, nothing of it is read.
    if (watch_->failed()) path_ = path_ + ".unusable/ddp-never-created";
  }

  c10::intrusive_ptr<c10d::Store> clone() override {
    return c10::make_intrusive<CheckedFileStore>(path_, numWorkers_, watch_);
  }

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    watch_->check();
    c10d::FileStore::set(key, value);
  }
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override {
    watch_->check();
    return c10d::FileStore::compareSet(key, expected, desired);
  }
  // c10d's get reads new records in a loop of its own: this loop checks the
  // file before each read instead.
  std::vector<uint8_t> get(const std::string& key) override {
    const auto start = Clock::now();
    while (!check({key})) {
      TORCH_CHECK(timeout_ == kNoTimeout || Clock::now() - start <= timeout_, "Timeout waiting for key: ", key,
                  " after ", timeout_.count(), " ms");
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    watch_->check();
    return c10d::FileStore::get(key);
  }
  int64_t add(const std::string& key, int64_t value) override {
    watch_->check();
    return c10d::FileStore::add(key, value);
  }
  int64_t getNumKeys() override {
    watch_->check();
    return c10d::FileStore::getNumKeys();
  }
  bool deleteKey(const std::string& key) override {
    watch_->check();
    return c10d::FileStore::deleteKey(key);
  }
  bool check(const std::vector<std::string>& keys) override {
    watch_->check();
    return c10d::FileStore::check(keys);
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    watch_->check();
    c10d::FileStore::wait(keys, timeout);  // polls through check() above
  }
  std::vector<std::string> listKeys() override {
    watch_->check();
    return c10d::FileStore::listKeys();
  }

 private:
  // c10d's constructor already reads the file (it counts a reference).
  static const std::string& checked_first(const std::string& path, StoreFileWatch& watch) {
    watch.check();
    return path;
  }

  std::shared_ptr<StoreFileWatch> watch_;
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
  c10::intrusive_ptr<c10d::FileStore> file;
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
      if (file) (void)c10::intrusive_ptr<c10d::FileStore>(file).release();
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
