// A check shared by the checkpoint tests (test_fsdp_state_dict.cpp,
// test_distributed_checkpoint.cpp): a run resumed from a checkpoint lands
// where an uninterrupted one does. Needs gtest.
#pragma once

#include "support/fsdp_nets.h"
#include "support/fsdp_trainers.h"
#include "support/ranks.h"

#include <ddp/checkpoint.h>

#include <gtest/gtest.h>

#include <string>

namespace ddp::testing {

/// Trains `spec` (which says what to load) for steps 3 to 5 from another
/// initial model, so the load must replace every weight, and expects on rank
/// 0 the weights of 6 uninterrupted steps saved in `reference`.
inline void expect_resumes_to(const Group& group, TrainSpec spec, const std::string& reference,
                              const std::string& label) {
  spec.init_seed = 5;
  spec.first_step = 3;
  spec.steps = 3;
  const auto resumed = train(group, spec).state;
  if (group->rank() == 0) {
    EXPECT_LE(max_difference(ddp::load_state_dict(reference), resumed), 1e-5)
        << label << " at " << group->size() << " ranks";
  }
}

}  // namespace ddp::testing
