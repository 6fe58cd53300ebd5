// Linked into ft_worker only: sets FaultTolerance's seams (src/launch/test_seams.h) from the
// environment before main() runs, for tests/test_ft_vote.cpp:
//   FT_TEST_LOSE_VOTE_AT=S        on the worker with RANK=FT_TEST_LOSE_VOTE_RANK (default 1),
//                                 the group's answer to step S's vote is dropped once
//   FT_TEST_PUBLISH_DELAY_MS=MS   every other worker waits MS before publishing its last commit
//   FT_TEST_STALL_STORE_MS=MS     on the worker with RANK=FT_TEST_STALL_RANK, once it first sees
//                                 a step fail, every store operation of both its connections
//                                 waits until MS have passed (its store is cut off: what an etcd
//                                 member that dies as the leader does to its clients)
#include "launch/test_seams.h"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

namespace {

using Clock = std::chrono::steady_clock;

std::atomic<int64_t> stall_until_ns{0};

void wait_out_the_stall() {
  const int64_t until = stall_until_ns.load();
  const int64_t now = Clock::now().time_since_epoch().count();
  if (until > now) std::this_thread::sleep_for(std::chrono::nanoseconds(until - now));
}

// Every operation FaultTolerance and Gloo's rendezvous make, each after the stall.
class StallingStore : public c10d::Store {
 public:
  explicit StallingStore(c10::intrusive_ptr<c10d::Store> inner) : inner_(std::move(inner)) {}
  c10::intrusive_ptr<c10d::Store> clone() override { return c10::make_intrusive<StallingStore>(inner_->clone()); }
  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    wait_out_the_stall();
    inner_->set(key, value);
  }
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override {
    wait_out_the_stall();
    return inner_->compareSet(key, expected, desired);
  }
  std::vector<uint8_t> get(const std::string& key) override {
    wait_out_the_stall();
    return inner_->get(key);
  }
  int64_t add(const std::string& key, int64_t value) override {
    wait_out_the_stall();
    return inner_->add(key, value);
  }
  bool deleteKey(const std::string& key) override {
    wait_out_the_stall();
    return inner_->deleteKey(key);
  }
  bool check(const std::vector<std::string>& keys) override {
    wait_out_the_stall();
    return inner_->check(keys);
  }
  int64_t getNumKeys() override {
    wait_out_the_stall();
    return inner_->getNumKeys();
  }
  void wait(const std::vector<std::string>& keys) override {
    wait_out_the_stall();
    inner_->wait(keys);
  }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    wait_out_the_stall();
    inner_->wait(keys, timeout);
  }
  const std::chrono::milliseconds& getTimeout() const noexcept override { return inner_->getTimeout(); }
  void setTimeout(const std::chrono::milliseconds& timeout) override { inner_->setTimeout(timeout); }

 private:
  c10::intrusive_ptr<c10d::Store> inner_;
};

bool rank_is(const char* variable, const char* fallback) {
  const char* rank = std::getenv("RANK");
  const char* chosen = std::getenv(variable);
  return std::string(rank ? rank : "") == std::string(chosen ? chosen : fallback);
}

[[maybe_unused]] const bool seams_set = [] {
  auto& seams = ddp::detail::test_seams();
  const bool is_loser = rank_is("FT_TEST_LOSE_VOTE_RANK", "1");
  const char* at = std::getenv("FT_TEST_LOSE_VOTE_AT");
  if (at != nullptr && is_loser) seams.ft_vote_answer_lost_at_step = std::atoll(at);
  const char* ms = std::getenv("FT_TEST_PUBLISH_DELAY_MS");
  if (ms != nullptr && !is_loser) seams.ft_publish_commit_delay = std::chrono::milliseconds(std::atoll(ms));
  const char* stall = std::getenv("FT_TEST_STALL_STORE_MS");
  if (stall != nullptr && rank_is("FT_TEST_STALL_RANK", "")) {
    const auto length = std::chrono::milliseconds(std::atoll(stall));
    seams.ft_wrap_store = [](c10::intrusive_ptr<c10d::Store> store) -> c10::intrusive_ptr<c10d::Store> {
      return c10::make_intrusive<StallingStore>(std::move(store));
    };
    seams.ft_on_failure_seen = [length] {
      static std::atomic<bool> once{false};
      if (once.exchange(true)) return;
      stall_until_ns = (Clock::now() + length).time_since_epoch().count();
    };
  }
  return true;
}();

}  // namespace
