// Precompiled for every ddp target: the torch headers nearly all of them use.
// Keep it to headers that are stable and widely included; adding a rarely used
// one makes every build slower, not faster.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <ATen/Functions.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
