// The gradient engine under DDP and FSDP (src/engine/gradient_sync_engine.h), driven by
// a recording policy on real ranks: its launch order, its end-of-backward
// rules and its guards, whatever order each rank's gradients arrive in.
#include "support/ranks.h"

#include "engine/gradient_sync_engine.h"
#include <ddp/error.h>
#include <ddp/process_group.h>

#include <ATen/Functions.h>
#include <torch/autograd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

namespace {

using ddp::testing::expect_all_succeeded;
using ddp::testing::run_on_ranks;

// Three one-element parameters, one group each. Each launch all-reduces the
// group's number, so the sum shows whether every rank launched the same group
// at that point.
class RecordingPolicy : public ddp::detail::ReductionPolicy {
 public:
  explicit RecordingPolicy(std::shared_ptr<ddp::ProcessGroup> group) : group_(std::move(group)) {}

  std::vector<size_t> on_round_start(bool synchronised) override {
    events.push_back(synchronised ? "start" : "start unsynced");
    return order;
  }
  void on_gradient_ready(size_t param, bool has_gradient) override {
    events.push_back("ready " + std::to_string(param) + (has_gradient ? "" : " zero"));
  }
  c10::intrusive_ptr<c10::ivalue::Future> launch_group(size_t g) override {
    events.push_back("launch " + std::to_string(g));
    launched.push_back(g);
    if (g == failing_group) {
      auto failed = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
      failed->setError(std::make_exception_ptr(std::runtime_error("the wire was cut")));
      return failed;
    }
    at::Tensor number = at::full({1}, static_cast<float>(g));
    return group_->all_reduce_async(number)->getFuture();
  }
  void on_group_complete_without_sync(size_t g) override { events.push_back("unsynced " + std::to_string(g)); }
  void before_waiting(const std::vector<char>& used) override { used_locally = used; }
  void finish_group(size_t g, const at::Tensor& result) override {
    sums.push_back(static_cast<double>(result.item<float>()) / static_cast<double>(g == 0 ? 1 : g));
    finished.push_back(g);
  }
  void on_round_end(bool synchronised) override { events.push_back(synchronised ? "end" : "end unsynced"); }
  std::string group_label(size_t g) const override { return "test group " + std::to_string(g); }
  std::string collective_tag(size_t g) const override { return "test group " + std::to_string(g); }
  bool tracks_rounds_without_sync() const override { return tracked; }

  size_t position_of(const std::string& event) const {
    return std::find(events.begin(), events.end(), event) - events.begin();
  }

  std::vector<size_t> order = {0, 1, 2};
  bool tracked = false;  // FSDP's no_sync() passes, reported per group
  size_t failing_group = SIZE_MAX;
  std::vector<std::string> events;
  std::vector<size_t> launched, finished;
  std::vector<double> sums;
  std::vector<char> used_locally;

 private:
  std::shared_ptr<ddp::ProcessGroup> group_;
};

struct Fixture {
  explicit Fixture(const std::shared_ptr<ddp::ProcessGroup>& group, ddp::detail::EngineOptions options,
                   bool tracked = false)
      : policy(group) {
    policy.tracked = tracked;
    for (int i = 0; i < 3; ++i) params.push_back(at::ones({1}).requires_grad_(true));
    sync = std::make_unique<ddp::detail::GradientSyncEngine>(params, std::vector<std::string>{"a", "b", "c"}, group,
                                                             policy, options);
    sync->set_groups({{0}, {1}, {2}});
  }
  RecordingPolicy policy;
  std::vector<at::Tensor> params;
  std::unique_ptr<ddp::detail::GradientSyncEngine> sync;
};

ddp::detail::EngineOptions allowing_unused() {
  ddp::detail::EngineOptions options;
  options.allow_unused = true;
  return options;
}

std::string error_of(const std::function<void()>& body) {
  try {
    body();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Rank 1 leaves b unused, so its group 2 (c) is complete long before group 1:
// it still waits for group 1, which the end of backward launches with zeros.
TEST(GradientSync, EveryRankLaunchesTheSameGroupsInTheSameOrderWhateverArrivesFirst) {
  auto ranks = run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    Fixture f(group, allowing_unused());
    at::Tensor a = f.params[0], b = f.params[1], c = f.params[2];
    at::Tensor loss = group->rank() == 0 ? (a * 1 + b * 2 + c * 3).sum() : (c * 3 + a).sum();
    loss.backward();
    EXPECT_EQ(f.policy.launched, (std::vector<size_t>{0, 1, 2}));
    EXPECT_EQ(f.policy.finished, (std::vector<size_t>{0, 1, 2}));
    // Each group's number summed over both ranks: 2g if they matched.
    EXPECT_EQ(f.policy.sums, (std::vector<double>{0.0, 2.0, 2.0}));
    if (group->rank() == 1) {
      EXPECT_LT(f.policy.position_of("ready 1 zero"), f.policy.position_of("launch 1"));
      EXPECT_LT(f.policy.position_of("ready 2"), f.policy.position_of("ready 1 zero"));
      EXPECT_EQ(f.policy.used_locally, (std::vector<char>{1, 0, 1}));
    }
    EXPECT_EQ(f.sync->synchronised_rounds(), 1);
  });
  expect_all_succeeded(ranks);
}

// With find_unreachable the same unused parameter is known when backward
// starts, so its group launches at once instead of at the end.
TEST(GradientSync, UnreachableParametersAreReadyWhenBackwardStarts) {
  auto ranks = run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    Fixture f(group, allowing_unused());
    at::Tensor a = f.params[0], c = f.params[2];
    at::Tensor loss = (c * 3 + a).sum();
    f.sync->find_unreachable({loss});
    loss.backward();
    EXPECT_EQ(f.policy.events.at(0), "start");
    EXPECT_EQ(f.policy.events.at(1), "ready 1 zero");
    EXPECT_EQ(f.policy.launched, (std::vector<size_t>{0, 1, 2}));
    EXPECT_EQ(f.policy.sums, (std::vector<double>{0.0, 2.0, 2.0}));
  });
  expect_all_succeeded(ranks);
}

// Without permission an unused parameter is an error naming it, raised only
// after every group has been launched: the other rank, which used all of
// them, completes its collectives instead of waiting out the timeout.
TEST(GradientSync, AnUnusedParameterIsAnErrorAfterEveryGroupHasLaunched) {
  auto ranks = run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    Fixture f(group, ddp::detail::EngineOptions());
    at::Tensor a = f.params[0], b = f.params[1], c = f.params[2];
    if (group->rank() == 0) {
      (a + b + c).sum().backward();
      EXPECT_EQ(f.policy.finished, (std::vector<size_t>{0, 1, 2}));
      return;
    }
    std::string message = error_of([&] { (a + c).sum().backward(); });
    EXPECT_NE(message.find("these parameters got no gradient: 'b'"), std::string::npos) << message;
    EXPECT_NE(message.find("find_unused_parameters(true)"), std::string::npos) << message;
    EXPECT_EQ(f.policy.launched, (std::vector<size_t>{0, 1, 2}));
    EXPECT_TRUE(f.policy.finished.empty());
    // The pass is over: the next forward may run.
    EXPECT_EQ(error_of([&] { f.sync->check_previous_round_finished(); }), "");
  });
  expect_all_succeeded(ranks);
}

// A backward that throws part-way leaves the pass open: the next forward's
// check says so (with the owner's name), once, and the engine works again.
TEST(GradientSync, AnInterruptedBackwardIsAnErrorAtTheNextForward) {
  auto ranks = run_on_ranks(1, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    ddp::detail::EngineOptions options;
    options.owner = " through TheWrapper";
    options.collectives = "reduce-scatters";
    Fixture f(group, options);
    at::Tensor a = f.params[0], b = f.params[1], c = f.params[2];
    at::Tensor x = a * 2;
    x.register_hook([](const at::Tensor&) -> at::Tensor { throw std::runtime_error("boom in backward"); });
    at::Tensor loss = (x + b + c).sum();
    EXPECT_NE(error_of([&] { loss.backward(); }).find("boom in backward"), std::string::npos);
    EXPECT_TRUE(f.sync->round_active());
    std::string message = error_of([&] { f.sync->check_previous_round_finished(); });
    EXPECT_NE(message.find("the previous backward pass through TheWrapper on rank 0 did not finish"),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("its gradient reduce-scatters may not match"), std::string::npos) << message;
    EXPECT_EQ(error_of([&] { f.sync->check_previous_round_finished(); }), "");
    for (auto& p : f.params) p.mutable_grad().reset();
    (a + b + c).sum().backward();
    EXPECT_EQ(f.sync->synchronised_rounds(), 1);
  });
  expect_all_succeeded(ranks);
}

// no_sync(): no collective. Tracked (FSDP), complete groups are reported as
// such; untracked (DDP), the pass does not even start. Either way a gradient
// from a no_sync() pass counts as used at the next synchronised one.
TEST(GradientSync, NoSyncPassesStartNoCollectiveAndTheirGradientsCountLater) {
  auto ranks = run_on_ranks(2, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    for (bool tracked : {true, false}) {
      Fixture f(group, allowing_unused(), tracked);
      at::Tensor a = f.params[0], b = f.params[1], c = f.params[2];
      f.sync->set_require_sync(false);
      (a + b).sum().backward();
      EXPECT_TRUE(f.policy.launched.empty()) << tracked;
      if (tracked) {
        // a and b in autograd's order, then c (no gradient) at the end.
        auto& events = f.policy.events;
        ASSERT_EQ(events.size(), 5u);
        EXPECT_EQ(events.front(), "start unsynced");
        EXPECT_EQ(events.back(), "end unsynced");
        EXPECT_EQ(events[3], "unsynced 2");
        std::vector<std::string> first_two(events.begin() + 1, events.begin() + 3);
        std::sort(first_two.begin(), first_two.end());
        EXPECT_EQ(first_two, (std::vector<std::string>{"unsynced 0", "unsynced 1"}));
      } else {
        EXPECT_TRUE(f.policy.events.empty());
      }
      f.sync->set_require_sync(true);
      c.sum().backward();
      EXPECT_EQ(f.policy.launched, (std::vector<size_t>{0, 1, 2})) << tracked;
      EXPECT_EQ(f.policy.used_locally, (std::vector<char>{1, 1, 1})) << tracked;
      EXPECT_EQ(f.sync->synchronised_rounds(), 1) << tracked;
    }
  });
  expect_all_succeeded(ranks);
}

// A reduction that fails inside the end of backward also leaves the engine
// refusing the next forward once: some gradients were reduced and some not.
TEST(GradientSync, AFailedReductionIsAnErrorAtTheNextForward) {
  auto ranks = run_on_ranks(1, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    Fixture f(group, ddp::detail::EngineOptions());
    f.policy.failing_group = 1;
    at::Tensor a = f.params[0], b = f.params[1], c = f.params[2];
    std::string message = error_of([&] { (a + b + c).sum().backward(); });
    EXPECT_NE(message.find("reducing test group 1 failed on rank 0 of 1"), std::string::npos) << message;
    EXPECT_NE(message.find("the wire was cut"), std::string::npos) << message;
    EXPECT_EQ(f.policy.finished, (std::vector<size_t>{0}));
    message = error_of([&] { f.sync->check_previous_round_finished(); });
    EXPECT_NE(message.find("did not finish"), std::string::npos) << message;
    EXPECT_EQ(error_of([&] { f.sync->check_previous_round_finished(); }), "");
  });
  expect_all_succeeded(ranks);
}

// A gradient for a parameter the forward's outputs could not reach (so it was
// counted as unused when backward started) is named, not silently dropped.
TEST(GradientSync, AGradientForAParameterCountedUnusedIsNamed) {
  auto ranks = run_on_ranks(1, [](const std::shared_ptr<ddp::ProcessGroup>& group) {
    Fixture f(group, allowing_unused());
    at::Tensor a = f.params[0], b = f.params[1], c = f.params[2];
    at::Tensor out = a * 2 + c;
    f.sync->find_unreachable({out});
    at::Tensor side = b * 3;  // not among the outputs the engine was shown
    std::string message = error_of([&] { (out + side).sum().backward(); });
    EXPECT_NE(message.find("parameter 'b' got a gradient, but the forward's outputs cannot reach it"),
              std::string::npos)
        << message;
  });
  expect_all_succeeded(ranks);
}

}  // namespace
