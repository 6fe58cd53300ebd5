// The optimizer-state re-layouts of src/checkpoint/optimizer_state.h:
// pure functions, tested on small hand-made states and on real Adam states.

#include "checkpoint/optimizer_state.h"
#include <ddp/snapshot.h>

#include <ATen/Functions.h>
#include <gtest/gtest.h>
#include <support/torch_errors.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <string>
#include <vector>

namespace {

using ddp::detail::FlatLayout;
using ddp::detail::GenericDict;
using ddp::detail::GenericList;
using ddp::testing::error_of;

// {"step": step, "exp_avg": values}
GenericDict entry(double step, const at::Tensor& values) {
  GenericDict d = ddp::detail::new_generic_dict();
  d.insert("step", at::scalar_tensor(step));
  d.insert("exp_avg", values);
  return d;
}

GenericDict group_with_lr(double lr, int64_t params) {
  GenericDict g = ddp::detail::new_generic_dict();
  g.insert("lr", lr);
  g.insert("params", ddp::detail::index_list(params));
  return g;
}

std::vector<int64_t> keys_of(const GenericDict& d) {
  std::vector<int64_t> keys;
  for (const auto& item : d) keys.push_back(item.key().toInt());
  return keys;
}

std::vector<int64_t> params_of(const c10::IValue& state) {
  std::vector<int64_t> params;
  auto group = state.toGenericDict().at("param_groups").toList().get(0).toGenericDict();
  for (const auto& p : group.at("params").toListRef()) params.push_back(p.toInt());
  return params;
}

TEST(OptimizerState, IndexListIsAListOfAnySoPythonCanUnpickleIt) {
  GenericList list = ddp::detail::index_list(3);
  EXPECT_EQ(list.elementType()->kind(), c10::TypeKind::AnyType);
  ASSERT_EQ(list.size(), 3u);
  EXPECT_EQ(list.get(2).toInt(), 2);
  EXPECT_EQ(ddp::detail::index_list(0).size(), 0u);
}

TEST(OptimizerState, ParseRefusesWhatIsNotPythonsLayoutNamingTheCaller) {
  EXPECT_NE(error_of([] { ddp::detail::parse_optimizer_state(c10::IValue(3), "the caller"); }).find("the caller"),
            std::string::npos);
  GenericDict no_groups = ddp::detail::new_generic_dict();
  no_groups.insert("state", ddp::detail::new_generic_dict());
  EXPECT_NE(error_of([&] { ddp::detail::parse_optimizer_state(no_groups, "x"); }).find("'param_groups'"),
            std::string::npos);

  auto state = ddp::detail::make_optimizer_state(ddp::detail::new_generic_dict(), GenericList(c10::AnyType::get()));
  auto parts = ddp::detail::parse_optimizer_state(state, "x");
  EXPECT_EQ(parts.state.size(), 0u);
  EXPECT_EQ(parts.param_groups.size(), 0u);
}

TEST(OptimizerState, SingleParamGroupChecksTheCountAndCopies) {
  GenericList groups(c10::AnyType::get());
  groups.push_back(group_with_lr(0.1, 3));
  auto state = ddp::detail::make_optimizer_state(ddp::detail::new_generic_dict(), groups);
  auto parts = ddp::detail::parse_optimizer_state(state, "x");
  auto group = ddp::detail::single_param_group(parts, 3, "x");
  group.insert_or_assign("lr", 0.5);  // a copy: the state's own group keeps 0.1
  EXPECT_DOUBLE_EQ(parts.param_groups.get(0).toGenericDict().at("lr").toDouble(), 0.1);

  auto message = error_of([&] { ddp::detail::single_param_group(parts, 4, "the loader"); });
  EXPECT_NE(message.find("has 3 parameters but this one has 4"), std::string::npos) << message;
  groups.push_back(group_with_lr(0.2, 1));
  message = error_of([&] { ddp::detail::single_param_group(parts, 3, "the loader"); });
  EXPECT_NE(message.find("supports one parameter group, got 2"), std::string::npos) << message;
}

TEST(OptimizerState, OneGroupStateOrdersByIndexAndListsEveryParameter) {
  GenericDict state = ddp::detail::new_generic_dict();
  state.insert(int64_t{2}, entry(1, at::zeros({1})));
  state.insert(int64_t{0}, entry(1, at::zeros({1})));
  state.insert(int64_t{7}, entry(1, at::zeros({1})));  // beyond the count: left out
  GenericDict group = group_with_lr(0.1, 1);
  auto result = ddp::detail::one_group_state(state, group, 4);
  EXPECT_EQ(keys_of(result.toGenericDict().at("state").toGenericDict()), (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(params_of(result), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_DOUBLE_EQ(result.toGenericDict().at("param_groups").toList().get(0).toGenericDict().at("lr").toDouble(), 0.1);
  // The template is not changed.
  EXPECT_EQ(group.at("params").toListRef().size(), 1u);
}

// ZeRO: rank r's shard holds the parameters local[r]; each rank's state,
// scattered to global indices and merged, is the full state, and gathering
// it back gives each rank its own.
TEST(OptimizerState, ZeroShardsScatterToGlobalIndicesAndGatherBack) {
  const std::vector<std::vector<int64_t>> local = {{1, 3}, {0, 2, 4}};
  std::vector<GenericDict> shards(2, GenericDict(c10::AnyType::get(), c10::AnyType::get()));
  std::vector<GenericDict> scattered;
  for (size_t r = 0; r < local.size(); ++r) {
    shards[r] = ddp::detail::new_generic_dict();
    for (size_t position = 0; position < local[r].size(); ++position) {
      // Parameter 4 not stepped yet: no entry.
      if (local[r][position] == 4) continue;
      shards[r].insert(static_cast<int64_t>(position), entry(1, at::full({1}, double(local[r][position]))));
    }
    scattered.push_back(ddp::detail::scatter_state(shards[r], local[r]));
  }
  auto full = ddp::detail::one_group_state(ddp::detail::merge_states(scattered), group_with_lr(0.1, 2), 5);
  auto full_state = full.toGenericDict().at("state").toGenericDict();
  EXPECT_EQ(keys_of(full_state), (std::vector<int64_t>{0, 1, 2, 3}));
  for (int64_t i = 0; i < 4; ++i) {
    EXPECT_EQ(full_state.at(i).toGenericDict().at("exp_avg").toTensor().item<double>(), i);
  }
  for (size_t r = 0; r < local.size(); ++r) {
    auto back = ddp::detail::gather_state(full_state, local[r]);
    ASSERT_EQ(keys_of(back), keys_of(shards[r]));
    for (const auto& item : back) {
      EXPECT_TRUE(at::equal(item.value().toGenericDict().at("exp_avg").toTensor(),
                            shards[r].at(item.key()).toGenericDict().at("exp_avg").toTensor()));
    }
  }
  auto message = error_of([&] { ddp::detail::scatter_state(shards[1], {0}); });
  EXPECT_NE(message.find("entry 1 is beyond the 1 parameters"), std::string::npos) << message;
}

// FSDP: a unit of a [2, 3] weight and a [3] bias in a flat tensor padded
// from 9 to 10 elements.
FlatLayout two_parameter_layout() {
  FlatLayout layout;
  layout.names = {"fc.weight", "fc.bias"};
  layout.offsets = {0, 6};
  layout.shapes = {{2, 3}, {3}};
  layout.padded = 10;
  return layout;
}

TEST(OptimizerState, FlatEntrySplitsPerParameterAndJoinsBackWithZeroPadding) {
  FlatLayout layout = two_parameter_layout();
  at::Tensor flat_values = at::arange(10, at::kFloat);
  GenericDict flat = entry(5, flat_values);
  auto per_param = ddp::detail::split_flat_entry(flat, layout);
  ASSERT_EQ(per_param.size(), 2u);
  at::Tensor weight = per_param[0].at("exp_avg").toTensor();
  at::Tensor bias = per_param[1].at("exp_avg").toTensor();
  EXPECT_EQ(weight.sizes(), (c10::IntArrayRef{2, 3}));
  EXPECT_TRUE(at::equal(weight.reshape({-1}), at::arange(6, at::kFloat)));
  EXPECT_TRUE(at::equal(bias, at::arange(6, 9, at::kFloat)));
  // "step" is the whole unit's, not split per element; every tensor is a copy.
  EXPECT_EQ(per_param[1].at("step").toTensor().item<double>(), 5);
  EXPECT_FALSE(per_param[0].at("step").toTensor().is_same(per_param[1].at("step").toTensor()));
  weight.fill_(-1);
  EXPECT_EQ(flat_values[0].item<float>(), 0);

  per_param[0].insert_or_assign("exp_avg", at::arange(6, at::kFloat).view({2, 3}));
  GenericDict joined = ddp::detail::join_flat_entry(per_param, layout);
  at::Tensor expected = at::arange(10, at::kFloat);
  expected[9] = 0;  // padding
  EXPECT_TRUE(at::equal(joined.at("exp_avg").toTensor(), expected));
  EXPECT_EQ(joined.at("step").toTensor().item<double>(), 5);
}

TEST(OptimizerState, JoinNamesTheParameterWhoseStateDoesNotFit) {
  FlatLayout layout = two_parameter_layout();
  std::vector<GenericDict> entries = {entry(1, at::zeros({2, 3})), entry(1, at::zeros({4}))};
  auto message = error_of([&] { ddp::detail::join_flat_entry(entries, layout); });
  EXPECT_NE(message.find("'exp_avg' of parameter 'fc.bias' does not match its shape [3]"), std::string::npos)
      << message;
  GenericDict no_moment = ddp::detail::new_generic_dict();
  no_moment.insert("step", at::scalar_tensor(1.0));
  entries = {entry(1, at::zeros({2, 3})), no_moment};
  message = error_of([&] { ddp::detail::join_flat_entry(entries, layout); });
  EXPECT_NE(message.find("of parameter 'fc.bias'"), std::string::npos) << message;
  message = error_of([&] { ddp::detail::split_flat_entry(entry(1, at::zeros({9})), layout); });
  EXPECT_NE(message.find("10 elements"), std::string::npos) << message;
}

TEST(OptimizerState, SliceTakesOneRanksPartOfPerElementStateOnly) {
  GenericDict flat = entry(3, at::arange(10, at::kFloat));
  GenericDict part = ddp::detail::slice_flat_entry(flat, 5, 5);
  EXPECT_TRUE(at::equal(part.at("exp_avg").toTensor(), at::arange(5, 10, at::kFloat)));
  EXPECT_EQ(part.at("step").toTensor().item<double>(), 3);
  part.at("exp_avg").toTensor().fill_(0);  // a copy
  EXPECT_EQ(flat.at("exp_avg").toTensor()[9].item<float>(), 9);
  auto message = error_of([&] { ddp::detail::slice_flat_entry(flat, 8, 5); });
  EXPECT_NE(message.find("too few for the part [8, 13)"), std::string::npos) << message;
}

TEST(OptimizerState, MapPerElementStateReplacesOnlyPerElementEntriesInOrder) {
  GenericDict flat = entry(3, at::ones({4}));
  flat.insert("momentum_buffer", c10::IValue());  // None: reaches fn as an undefined tensor
  std::vector<std::string> seen;
  GenericDict mapped = ddp::detail::map_per_element_state(flat, [&](const std::string& key, const at::Tensor& t) {
    seen.push_back(key);
    return t.defined() ? t * 2 : at::zeros({1});
  });
  EXPECT_EQ(seen, (std::vector<std::string>{"exp_avg", "momentum_buffer"}));
  EXPECT_TRUE(mapped.at("step").toTensor().is_same(flat.at("step").toTensor()));
  EXPECT_TRUE(at::equal(mapped.at("exp_avg").toTensor(), at::full({4}, 2.0)));
  std::vector<std::string> keys;
  for (const auto& item : mapped) keys.push_back(item.key().toStringRef());
  EXPECT_EQ(keys, (std::vector<std::string>{"step", "exp_avg", "momentum_buffer"}));
}

// A real Adam state, re-laid out as ZeRO does (a shard of parameters 0 and
// 2 of 3), loads into an Adam over those two parameters with the same
// moments and step.
TEST(OptimizerState, AnAdamStateRelaidForAShardLoadsIntoTheShardsOptimizer) {
  std::vector<at::Tensor> params = {at::randn({4}).requires_grad_(), at::randn({2, 2}).requires_grad_(),
                                    at::randn({3}).requires_grad_()};
  torch::optim::Adam full(params, torch::optim::AdamOptions(1e-2));
  for (int step = 0; step < 2; ++step) {
    full.zero_grad();
    at::Tensor loss = params[0].sum() + params[1].pow(2).sum() + params[2].sin().sum();
    loss.backward();
    full.step();
  }
  auto parts = ddp::detail::parse_optimizer_state(ddp::optimizer_state_dict(full), "test");
  auto group = ddp::detail::single_param_group(parts, 3, "test");
  const std::vector<int64_t> shard = {0, 2};
  auto relaid = ddp::detail::one_group_state(ddp::detail::gather_state(parts.state, shard), group, 2);

  std::vector<at::Tensor> shard_params = {params[0].detach().clone().requires_grad_(),
                                          params[2].detach().clone().requires_grad_()};
  torch::optim::Adam sharded(shard_params, torch::optim::AdamOptions(1.0));
  ddp::load_optimizer_state_dict(sharded, relaid);
  auto& options = static_cast<torch::optim::AdamOptions&>(sharded.param_groups()[0].options());
  EXPECT_DOUBLE_EQ(options.lr(), 1e-2);
  for (size_t i = 0; i < shard.size(); ++i) {
    auto& mine = static_cast<torch::optim::AdamParamState&>(*sharded.state().at(shard_params[i].unsafeGetTensorImpl()));
    auto& theirs = static_cast<torch::optim::AdamParamState&>(*full.state().at(params[shard[i]].unsafeGetTensorImpl()));
    EXPECT_EQ(mine.step(), theirs.step());
    EXPECT_TRUE(at::equal(mine.exp_avg(), theirs.exp_avg()));
    EXPECT_TRUE(at::equal(mine.exp_avg_sq(), theirs.exp_avg_sq()));
  }
}

}  // namespace
