#pragma once

// Internal, not API: the backend ProcessGroup talks to. It wraps Gloo's or
// NCCL's so that a collective which fails as it starts (Gloo throws at once
// when a peer's connection is already gone) and a wait that fails with one
// of Gloo's own exceptions (not c10::Errors) both become ddp errors naming
// the operation, the rank and the cause.

#include <ddp/env.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <chrono>

namespace ddp::detail {

c10::intrusive_ptr<c10d::Backend> make_checked_backend(c10::intrusive_ptr<c10d::Backend> inner, const World& world,
                                                       std::chrono::milliseconds timeout);

}  // namespace ddp::detail
