#pragma once

// Internal, not API: how the ranks of a TCP-store job find each other, for
// ProcessGroup::create. It knows nothing of ProcessGroup: it returns the
// store the group keeps.
//
//   std::optional<StoreDeadline> deadline;
//   deadline.emplace(world.master_port);
//   auto store = rendezvous(world, run_id, timeout, *deadline);
//   ... connect the backend over `store`; deadline->disarm();

#include <ddp/env.h>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <istream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace ddp::detail {

// Puts a deadline on the store client's reads. c10d's client reads some
// replies (its handshake's ping, add, get) without a time limit, so a master
// that accepts the connection and never answers would block a rank forever.
// When the deadline passes, this cuts (shutdown()) this process's
// connections to MASTER_ADDR:MASTER_PORT; the blocked read returns, c10d
// throws, and rendezvous reports what it was waiting for.
class StoreDeadline {
 public:
  using Clock = std::chrono::steady_clock;
  explicit StoreDeadline(int master_port) : master_port_(master_port) {}
  ~StoreDeadline();
  StoreDeadline(const StoreDeadline&) = delete;
  StoreDeadline& operator=(const StoreDeadline&) = delete;

  // From now until disarm(), a wait for `awaited` that is still going on at
  // `deadline` is cut.
  void arm(Clock::time_point deadline, std::string awaited);
  void disarm();
  // Whether a wait was cut.
  bool expired() const;
  std::string awaited() const;

 private:
  void run();
  void cut_store_connections();

  const int master_port_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::thread thread_;
  Clock::time_point deadline_;
  std::string awaited_;
  bool armed_ = false;
  bool expired_ = false;
  bool stop_ = false;
};

// Connects to the store (rank 0 hosts it on MASTER_ADDR:MASTER_PORT, unless
// TORCHELASTIC_USE_AGENT_STORE says torchrun's agent serves one) and checks
// the world (WorldCheck in rendezvous.cpp): run ids, one process per rank,
// one world size, every rank arrived; all within `timeout`. Returns the
// store for this job's keys ("run/<run id>/" within this restart's prefix).
// `deadline` stays armed for the backend's own connection, which follows.
c10::intrusive_ptr<c10d::Store> rendezvous(const World& world, const std::string& run_id,
                                           std::chrono::milliseconds timeout, StoreDeadline& deadline);

// torchrun's restart count (TORCHELASTIC_RESTART_COUNT, 0 when unset): a
// store that lives across restarts (torchrun's, or a store file) keeps each
// attempt's keys apart under "ddp/attempt_<count>", as Python's env:// does.
int restart_count();

// What a rank says when `deadline` had to cut a wait of c10d's (`cause` is
// c10d's error that followed): a PeerFailure naming what it waited for.
[[noreturn]] void throw_store_did_not_answer(const World& world, std::chrono::milliseconds timeout,
                                             const StoreDeadline& deadline, const c10::Error& cause);

// What each rank publishes when it joins, in both rendezvous (rendezvous.cpp
// and file_rendezvous.cpp): its world size and run id, and where it runs,
// for messages. Stored one field a line.
struct RankRecord {
  int world_size = 0;
  std::string run_id;
  std::string host;
  std::string pid;

  // "<world size>\n<run id>\n<host>\n<pid>".
  std::string encode() const;
  // Reads the four lines encode() writes from `in`; a world size that is no
  // number reads as -1, a missing line as empty.
  static RankRecord read(std::istream& in);
  static RankRecord decode(const std::string& text);
  std::string where() const { return "host " + host + ", pid " + pid; }
};

// A store value as text, and text as a store value.
std::string text_of(const std::vector<uint8_t>& bytes);
std::vector<uint8_t> bytes_of(const std::string& text);
// "0, 2, 5", or "none": ranks for a message.
std::string rank_list(const std::vector<int>& ranks);

// Time left until `deadline`, at least 1 ms: a store call given 0 would wait
// without limit.
std::chrono::milliseconds remaining(std::chrono::steady_clock::time_point deadline);

// Rank 0's wait, in both rendezvous, for the records of ranks 1..world_size-1.
// Each round starts with `check_stop` (which throws if the rendezvous was
// called off), then asks `has_arrived(r)` for each rank not yet seen (it may
// check the record and throw), then `sleep`s. At the deadline
// `at_deadline(arrived, missing)` reports who came, rank 0 counted as
// arrived; it must throw.
void wait_for_every_rank(int world_size, std::chrono::steady_clock::time_point deadline,
                         const std::function<bool(int)>& has_arrived, const std::function<void()>& check_stop,
                         const std::function<void()>& sleep,
                         const std::function<void(const std::vector<int>&, const std::vector<int>&)>& at_deadline);

}  // namespace ddp::detail
