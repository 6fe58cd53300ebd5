// How a Sequential root's children become FSDP units, and the order a
// unit's lifecycle calls may come in: the pure rules, without modules or
// processes.
#include "sharding/fsdp_runtime.h"
#include "sharding/fsdp_unit_grouping.h"

#include <ddp/error.h>

#include <gtest/gtest.h>

namespace {

using ddp::detail::group_sequential_children;
using Children = std::vector<std::pair<std::string, int64_t>>;

Children sized(std::vector<int64_t> numels) {
  Children children;
  for (size_t i = 0; i < numels.size(); ++i) children.emplace_back(std::to_string(i), numels[i]);
  return children;
}

std::vector<std::vector<size_t>> children_of(const std::vector<ddp::detail::SequentialGroup>& groups) {
  std::vector<std::vector<size_t>> out;
  for (const auto& g : groups) out.push_back(g.children);
  return out;
}

TEST(FsdpUnits, ChildrenAreGroupedUntilTheyHoldMinNumParams) {
  auto groups = group_sequential_children(sized({40, 40, 40, 100, 10, 10}), 80, {});
  EXPECT_EQ(children_of(groups), (std::vector<std::vector<size_t>>{{0, 1}, {2, 3}, {4, 5}}));
  EXPECT_EQ(groups[0].name, "0-1");
  EXPECT_EQ(groups[1].name, "2-3");
  for (const auto& g : groups) EXPECT_TRUE(g.forms_unit) << g.name;
}

TEST(FsdpUnits, ATailSmallerThanMinNumParamsIsAUnitOfItsOwn) {
  auto groups = group_sequential_children(sized({100, 5}), 100, {});
  EXPECT_EQ(children_of(groups), (std::vector<std::vector<size_t>>{{0}, {1}}));
  EXPECT_TRUE(groups[1].forms_unit);
  EXPECT_EQ(groups[1].name, "1");
}

TEST(FsdpUnits, AListedChildIsAUnitAndClosesTheGroupBeforeIt) {
  auto groups = group_sequential_children(sized({10, 10, 10, 10}), 1000, {"2"});
  EXPECT_EQ(children_of(groups), (std::vector<std::vector<size_t>>{{0, 1}, {2}, {3}}));
  for (const auto& g : groups) EXPECT_TRUE(g.forms_unit) << g.name;
}

TEST(FsdpUnits, WithoutASizePolicyOnlyListedChildrenFormUnits) {
  auto groups = group_sequential_children(sized({10, 10, 10}), 0, {"1"});
  EXPECT_EQ(children_of(groups), (std::vector<std::vector<size_t>>{{0}, {1}, {2}}));
  EXPECT_FALSE(groups[0].forms_unit);
  EXPECT_TRUE(groups[1].forms_unit);
  EXPECT_FALSE(groups[2].forms_unit);
}

TEST(FsdpUnits, ChildrenWithoutParametersStillRunInTheirGroup) {
  // Activations (0 parameters) join the group that is open.
  auto groups = group_sequential_children(sized({50, 0, 50, 0}), 50, {});
  EXPECT_EQ(children_of(groups), (std::vector<std::vector<size_t>>{{0}, {1, 2}, {3}}));
}

TEST(FsdpUnits, AListedNameThatIsNoChildIsRefused) {
  try {
    group_sequential_children(sized({1, 2}), 0, {"7"});
    FAIL() << "no error";
  } catch (const ddp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("FSDPOptions::units names '7'"), std::string::npos) << e.what();
  }
}

TEST(FsdpUnits, EveryChildIsInExactlyOneGroupInOrder) {
  for (int64_t min : {0, 1, 7, 1000}) {
    auto groups = group_sequential_children(sized({3, 0, 9, 2, 2, 11, 0, 1}), min, {"4"});
    size_t next = 0;
    for (const auto& g : groups) {
      for (size_t child : g.children) EXPECT_EQ(child, next++) << "min_num_params " << min;
    }
    EXPECT_EQ(next, 8u) << "min_num_params " << min;
  }
}

using ddp::detail::next_training_state;
using ddp::detail::TrainingState;
using ddp::detail::UnitEvent;

TEST(FsdpUnitState, AStepGoesForwardThenBackwardAndBackToIdle) {
  TrainingState state = TrainingState::kIdle;
  for (UnitEvent event : {UnitEvent::kPreForward, UnitEvent::kPostForward, UnitEvent::kPreBackward,
                          UnitEvent::kPostBackward, UnitEvent::kEndOfPass}) {
    state = next_training_state(state, event, "block");
  }
  EXPECT_EQ(state, TrainingState::kIdle);
  EXPECT_EQ(next_training_state(TrainingState::kIdle, UnitEvent::kPreForward, "block"), TrainingState::kForward);
  EXPECT_EQ(next_training_state(TrainingState::kForward, UnitEvent::kPostForward, "block"), TrainingState::kIdle);
}

TEST(FsdpUnitState, PreBackwardRepeatsAndAUnitWithoutOneStillReduces) {
  // One hook per output tensor: the second and later ones change nothing,
  // also once the unit's gradients have left.
  EXPECT_EQ(next_training_state(TrainingState::kPreBackward, UnitEvent::kPreBackward, "block"),
            TrainingState::kPreBackward);
  EXPECT_EQ(next_training_state(TrainingState::kPostBackward, UnitEvent::kPreBackward, "block"),
            TrainingState::kPostBackward);
  // A unit this forward did not run (or the root) reduces zeros.
  EXPECT_EQ(next_training_state(TrainingState::kIdle, UnitEvent::kPostBackward, "block"),
            TrainingState::kPostBackward);
  // An abandoned pass ends wherever it stopped.
  for (TrainingState state : {TrainingState::kIdle, TrainingState::kForward, TrainingState::kPreBackward,
                              TrainingState::kPostBackward}) {
    EXPECT_EQ(next_training_state(state, UnitEvent::kEndOfPass, "block"), TrainingState::kIdle);
  }
}

TEST(FsdpUnitState, ACallOutOfOrderIsAnInternalErrorNamingTheUnitAndState) {
  struct Case {
    TrainingState state;
    UnitEvent event;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {TrainingState::kForward, UnitEvent::kPreForward, "got pre_forward in state forward"},
      {TrainingState::kPreBackward, UnitEvent::kPreForward, "got pre_forward in state pre-backward"},
      {TrainingState::kIdle, UnitEvent::kPostForward, "got post_forward in state idle"},
      {TrainingState::kForward, UnitEvent::kPreBackward, "got pre_backward in state forward"},
      {TrainingState::kPostBackward, UnitEvent::kPostBackward, "got post_backward in state post-backward"},
      {TrainingState::kForward, UnitEvent::kPostBackward, "got post_backward in state forward"},
  };
  for (const auto& c : cases) {
    try {
      next_training_state(c.state, c.event, "block");
      ADD_FAILURE() << "no error for " << c.expected;
    } catch (const ddp::Error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("internal error: FSDP unit 'block' " + c.expected), std::string::npos) << message;
    }
  }
}

}  // namespace
