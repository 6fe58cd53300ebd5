// The optimizer state in Python's layout: pure re-layouts (see
// src/checkpoint/optimizer_state.h), and the conversion from and to a
// torch::optim::Optimizer (ddp::optimizer_state_dict and
// ddp::load_optimizer_state_dict, declared in include/ddp/snapshot.h).

#include "checkpoint/optimizer_state.h"

#include <ddp/error.h>
#include <ddp/snapshot.h>

#include <ATen/Functions.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <functional>
#include <memory>
#include <utility>

namespace ddp {
namespace detail {

GenericDict new_generic_dict() { return GenericDict(c10::AnyType::get(), c10::AnyType::get()); }

GenericList index_list(int64_t count) {
  GenericList indices(c10::AnyType::get());
  for (int64_t i = 0; i < count; ++i) indices.push_back(i);
  return indices;
}

OptimizerStateParts parse_optimizer_state(const c10::IValue& value, const std::string& who) {
  const bool ok = value.isGenericDict() && value.toGenericDict().contains("state") &&
                  value.toGenericDict().contains("param_groups") &&
                  value.toGenericDict().at("state").isGenericDict() &&
                  value.toGenericDict().at("param_groups").isList();
  DDP_CHECK(ok, "ddp: ", who, " needs an optimizer state in the layout of Python's optimizer.state_dict(): a dict ",
            "with the entries 'state' (a dict) and 'param_groups' (a list)");
  auto dict = value.toGenericDict();
  return {dict.at("state").toGenericDict(), dict.at("param_groups").toList()};
}

c10::IValue make_optimizer_state(GenericDict state, GenericList param_groups) {
  GenericDict result = new_generic_dict();
  result.insert("state", std::move(state));
  result.insert("param_groups", std::move(param_groups));
  return result;
}

GenericDict single_param_group(const OptimizerStateParts& parts, int64_t expected_params, const std::string& who) {
  DDP_CHECK(parts.param_groups.size() == 1, "ddp: ", who, " supports one parameter group, got ",
            parts.param_groups.size());
  const c10::IValue group = parts.param_groups.get(0);
  DDP_CHECK(group.isGenericDict() && group.toGenericDict().contains("params") &&
                group.toGenericDict().at("params").isList(),
            "ddp: ", who, ": the optimizer state's parameter group has no list 'params'");
  const int64_t listed = static_cast<int64_t>(group.toGenericDict().at("params").toListRef().size());
  DDP_CHECK(listed == expected_params, "ddp: ", who, ": the optimizer state has ", listed,
            " parameters but this one has ", expected_params);
  return group.toGenericDict().copy();
}

c10::IValue one_group_state(const GenericDict& state, const GenericDict& group, int64_t count) {
  GenericDict ordered = new_generic_dict();
  for (int64_t i = 0; i < count; ++i) {
    auto it = state.find(i);
    if (it != state.end()) ordered.insert(i, it->value());
  }
  GenericDict only = group.copy();
  only.insert_or_assign("params", index_list(count));
  GenericList groups(c10::AnyType::get());
  groups.push_back(only);
  return make_optimizer_state(ordered, groups);
}

GenericDict scatter_state(const GenericDict& state, const std::vector<int64_t>& new_index) {
  GenericDict result = new_generic_dict();
  for (const auto& item : state) {
    const int64_t key = item.key().toInt();
    DDP_CHECK(key >= 0 && key < static_cast<int64_t>(new_index.size()), "ddp: optimizer state entry ", key,
              " is beyond the ", new_index.size(), " parameters it can belong to");
    result.insert(new_index[static_cast<size_t>(key)], item.value());
  }
  return result;
}

GenericDict gather_state(const GenericDict& state, const std::vector<int64_t>& old_index) {
  GenericDict result = new_generic_dict();
  for (size_t i = 0; i < old_index.size(); ++i) {
    auto it = state.find(old_index[i]);
    if (it != state.end()) result.insert(static_cast<int64_t>(i), it->value());
  }
  return result;
}

GenericDict merge_states(const std::vector<GenericDict>& parts) {
  GenericDict merged = new_generic_dict();
  for (const auto& part : parts) {
    for (const auto& item : part) merged.insert(item.key(), item.value());
  }
  return merged;
}

namespace {

at::Tensor tensor_or_null(const c10::IValue& value) { return value.isTensor() ? value.toTensor() : at::Tensor(); }

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

void check_layout(const FlatLayout& layout) {
  DDP_CHECK(layout.offsets.size() == layout.shapes.size() && layout.names.size() == layout.shapes.size(),
            "ddp: a flat layout needs a name, an offset and a shape per parameter");
  for (size_t j = 0; j < layout.shapes.size(); ++j) {
    DDP_CHECK(layout.offsets[j] >= 0 && layout.offsets[j] + numel_of(layout.shapes[j]) <= layout.padded,
              "ddp: parameter '", layout.names[j], "' lies outside its flat tensor of ", layout.padded, " elements");
  }
}

}  // namespace

std::vector<GenericDict> split_flat_entry(const GenericDict& flat, const FlatLayout& layout) {
  check_layout(layout);
  // One dict each: copies of a GenericDict would share their contents.
  std::vector<GenericDict> per_param;
  for (size_t j = 0; j < layout.shapes.size(); ++j) per_param.push_back(new_generic_dict());
  for (const auto& item : flat) {
    const std::string key = item.key().toStringRef();
    at::Tensor tensor = tensor_or_null(item.value());
    if (is_per_element_state(key)) {
      DDP_CHECK(tensor.defined() && tensor.numel() == layout.padded, "ddp: optimizer state '", key,
                "' is not a tensor of the flat parameter's ", layout.padded, " elements");
      for (size_t j = 0; j < layout.shapes.size(); ++j) {
        per_param[j].insert(
            key, tensor.narrow(0, layout.offsets[j], numel_of(layout.shapes[j])).view(layout.shapes[j]).clone());
      }
    } else {
      for (size_t j = 0; j < layout.shapes.size(); ++j) {
        per_param[j].insert(key, tensor.defined() ? c10::IValue(tensor.clone()) : item.value());
      }
    }
  }
  return per_param;
}

GenericDict join_flat_entry(const std::vector<GenericDict>& entries, const FlatLayout& layout) {
  check_layout(layout);
  DDP_CHECK(!entries.empty() && entries.size() == layout.shapes.size(), "ddp: ", entries.size(),
            " optimizer state entries for ", layout.shapes.size(), " parameters");
  GenericDict flat = new_generic_dict();
  for (const auto& item : entries.front()) {
    const std::string key = item.key().toStringRef();
    if (!is_per_element_state(key)) {
      flat.insert(key, item.value());
      continue;
    }
    at::Tensor first = tensor_or_null(item.value());
    DDP_CHECK(first.defined(), "ddp: optimizer state '", key, "' of parameter '", layout.names.front(),
              "' is not a tensor");
    at::Tensor joined = at::zeros({layout.padded}, first.options());
    for (size_t j = 0; j < entries.size(); ++j) {
      at::Tensor value = entries[j].contains(key) ? tensor_or_null(entries[j].at(key)) : at::Tensor();
      DDP_CHECK(value.defined() && value.sizes() == c10::IntArrayRef(layout.shapes[j]), "ddp: optimizer state '",
                key, "' of parameter '", layout.names[j], "' does not match its shape ",
                c10::IntArrayRef(layout.shapes[j]));
      joined.narrow(0, layout.offsets[j], value.numel()).copy_(value.reshape({-1}));
    }
    flat.insert(key, joined);
  }
  return flat;
}

GenericDict slice_flat_entry(const GenericDict& flat, int64_t start, int64_t length) {
  return map_per_element_state(flat, [&](const std::string& key, const at::Tensor& tensor) {
    DDP_CHECK(tensor.defined(), "ddp: optimizer state '", key, "' is not a tensor");
    DDP_CHECK(start >= 0 && start + length <= tensor.numel(), "ddp: optimizer state '", key, "' has ",
              tensor.numel(), " elements, too few for the part [", start, ", ", start + length, ")");
    return tensor.narrow(0, start, length).clone();
  });
}

GenericDict map_per_element_state(const GenericDict& entry,
                                  const std::function<at::Tensor(const std::string&, const at::Tensor&)>& fn) {
  GenericDict result = new_generic_dict();
  for (const auto& item : entry) {
    const std::string key = item.key().toStringRef();
    if (is_per_element_state(key)) {
      result.insert(key, fn(key, tensor_or_null(item.value())));
    } else {
      result.insert(key, item.value());
    }
  }
  return result;
}

}  // namespace detail
namespace {

using GenericDict = c10::impl::GenericDict;
GenericDict new_dict() { return detail::new_generic_dict(); }

// Adam and AdamW keep the same state under different types.
template <typename State>
GenericDict adam_state(const State& state) {
  GenericDict d = new_dict();
  d.insert("step", at::scalar_tensor(static_cast<double>(state.step()), at::kFloat));
  d.insert("exp_avg", state.exp_avg());
  d.insert("exp_avg_sq", state.exp_avg_sq());
  if (state.max_exp_avg_sq().defined()) d.insert("max_exp_avg_sq", state.max_exp_avg_sq());
  return d;
}

// A saved state tensor, checked against its parameter and placed like it.
at::Tensor state_tensor(const GenericDict& d, const std::string& key, const at::Tensor& param, int64_t index) {
  DDP_CHECK(d.contains(key), "ddp: the optimizer state of parameter ", index, " has no '", key,
              "'; was it saved from a different optimizer?");
  at::Tensor t = d.at(key).toTensor();
  DDP_CHECK(t.sizes() == param.sizes(), "ddp: optimizer state '", key, "' of parameter ", index, " has shape ",
              t.sizes(), " but the parameter has ", param.sizes());
  return t.to(param.options().requires_grad(false), /*non_blocking=*/false, /*copy=*/true);
}

template <typename State>
std::unique_ptr<torch::optim::OptimizerParamState> adam_state_from(const GenericDict& d, const at::Tensor& param,
                                                                   int64_t index) {
  DDP_CHECK(d.contains("step"), "ddp: the optimizer state of parameter ", index,
              " has no 'step'; was it saved from a different optimizer?");
  auto state = std::make_unique<State>();
  state->step(static_cast<int64_t>(d.at("step").toTensor().item<double>()));
  state->exp_avg(state_tensor(d, "exp_avg", param, index));
  state->exp_avg_sq(state_tensor(d, "exp_avg_sq", param, index));
  if (d.contains("max_exp_avg_sq")) state->max_exp_avg_sq(state_tensor(d, "max_exp_avg_sq", param, index));
  return state;
}

template <typename Options>
GenericDict adam_group(const Options& o) {
  GenericDict g = new_dict();
  g.insert("lr", o.lr());
  g.insert("betas", c10::ivalue::Tuple::create({std::get<0>(o.betas()), std::get<1>(o.betas())}));
  g.insert("eps", o.eps());
  g.insert("weight_decay", o.weight_decay());
  g.insert("amsgrad", o.amsgrad());
  return g;
}

template <typename Options>
void set_adam_group(Options& o, const GenericDict& g) {
  o.lr(g.at("lr").toDouble());
  const auto& betas = g.at("betas").toTupleRef().elements();
  o.betas(std::make_tuple(betas[0].toDouble(), betas[1].toDouble()));
  o.eps(g.at("eps").toDouble());
  o.weight_decay(g.at("weight_decay").toDouble());
  o.amsgrad(g.at("amsgrad").toBool());
}

}  // namespace

c10::IValue optimizer_state_dict(torch::optim::Optimizer& optimizer) {
  GenericDict state = new_dict();
  c10::impl::GenericList groups(c10::AnyType::get());
  int64_t index = 0;
  for (auto& group : optimizer.param_groups()) {
    GenericDict g = new_dict();
    auto& options = group.options();
    if (auto* adam = dynamic_cast<torch::optim::AdamOptions*>(&options)) {
      g = adam_group(*adam);
    } else if (auto* adamw = dynamic_cast<torch::optim::AdamWOptions*>(&options)) {
      g = adam_group(*adamw);
    } else if (auto* sgd = dynamic_cast<torch::optim::SGDOptions*>(&options)) {
      g = new_dict();
      g.insert("lr", sgd->lr());
      g.insert("momentum", sgd->momentum());
      g.insert("dampening", sgd->dampening());
      g.insert("weight_decay", sgd->weight_decay());
      g.insert("nesterov", sgd->nesterov());
    } else {
      DDP_CHECK(false, "ddp: optimizer_state_dict supports Adam, AdamW and SGD");
    }
    c10::impl::GenericList params(c10::AnyType::get());  // typed lists pickle as torch.jit globals
    for (auto& p : group.params()) {
      params.push_back(index);
      auto it = optimizer.state().find(p.unsafeGetTensorImpl());
      if (it != optimizer.state().end()) {
        auto* s = it->second.get();
        if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(s)) {
          state.insert(index, adam_state(*a));
        } else if (auto* aw = dynamic_cast<torch::optim::AdamWParamState*>(s)) {
          state.insert(index, adam_state(*aw));
        } else if (auto* sg = dynamic_cast<torch::optim::SGDParamState*>(s)) {
          GenericDict d = new_dict();
          d.insert("momentum_buffer", sg->momentum_buffer());
          state.insert(index, d);
        }
      }
      ++index;
    }
    g.insert("params", params);
    groups.push_back(g);
  }
  return detail::make_optimizer_state(state, groups);
}

bool is_per_element_state(const std::string& key) { return key != "step"; }

void load_optimizer_state_dict(torch::optim::Optimizer& optimizer, const c10::IValue& value) {
  auto parts = detail::parse_optimizer_state(value, "load_optimizer_state_dict");
  GenericDict state = parts.state;
  auto groups = parts.param_groups.vec();
  DDP_CHECK(groups.size() == optimizer.param_groups().size(), "ddp: the optimizer state has ",
              groups.size(), " parameter groups but the optimizer has ", optimizer.param_groups().size());

  // Everything is read and checked first and applied only at the end, so a
  // bad file leaves the optimizer as it was.
  std::vector<std::function<void()>> set_options;
  std::vector<std::pair<void*, std::unique_ptr<torch::optim::OptimizerParamState>>> new_states;
  int64_t index = 0;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    auto& group = optimizer.param_groups()[gi];
    DDP_CHECK(groups[gi].isGenericDict(), "ddp: parameter group ", gi, " of the optimizer state is not a dict");
    GenericDict g = groups[gi].toGenericDict();
    auto field = [&](const char* key) -> c10::IValue {
      DDP_CHECK(g.contains(key), "ddp: parameter group ", gi, " of the optimizer state has no '", key,
                  "'; was it saved from a different optimizer?");
      return g.at(key);
    };
    DDP_CHECK(field("params").toListRef().size() == group.params().size(), "ddp: parameter group ", gi,
                " of the optimizer state has ", field("params").toListRef().size(),
                " parameters but the optimizer's has ", group.params().size());
    auto& options = group.options();
    enum class Kind { kAdam, kAdamW, kSgd } kind;
    if (auto* o = dynamic_cast<torch::optim::AdamOptions*>(&options)) {
      kind = Kind::kAdam;
      field("lr"), field("betas"), field("eps"), field("weight_decay"), field("amsgrad");
      set_options.push_back([o, g] { set_adam_group(*o, g); });
    } else if (auto* o = dynamic_cast<torch::optim::AdamWOptions*>(&options)) {
      kind = Kind::kAdamW;
      field("lr"), field("betas"), field("eps"), field("weight_decay"), field("amsgrad");
      set_options.push_back([o, g] { set_adam_group(*o, g); });
    } else if (auto* o = dynamic_cast<torch::optim::SGDOptions*>(&options)) {
      kind = Kind::kSgd;
      double lr = field("lr").toDouble(), momentum = field("momentum").toDouble();
      double dampening = field("dampening").toDouble(), weight_decay = field("weight_decay").toDouble();
      bool nesterov = field("nesterov").toBool();
      set_options.push_back([=] {
        o->lr(lr).momentum(momentum).dampening(dampening).weight_decay(weight_decay).nesterov(nesterov);
      });
    } else {
      DDP_CHECK(false, "ddp: load_optimizer_state_dict supports Adam, AdamW and SGD");
    }
    for (auto& p : group.params()) {
      std::unique_ptr<torch::optim::OptimizerParamState> restored;
      auto it = state.find(index);
      if (it != state.end()) {
        GenericDict s = it->value().toGenericDict();
        if (kind == Kind::kAdam) {
          restored = adam_state_from<torch::optim::AdamParamState>(s, p, index);
        } else if (kind == Kind::kAdamW) {
          restored = adam_state_from<torch::optim::AdamWParamState>(s, p, index);
        } else {
          auto sgd = std::make_unique<torch::optim::SGDParamState>();
          sgd->momentum_buffer(state_tensor(s, "momentum_buffer", p, index));
          restored = std::move(sgd);
        }
      }
      new_states.emplace_back(p.unsafeGetTensorImpl(), std::move(restored));
      ++index;
    }
  }
  for (auto& apply : set_options) apply();
  for (auto& [key, restored] : new_states) {
    optimizer.state().erase(key);
    if (restored) optimizer.state()[key] = std::move(restored);
  }
}

}  // namespace ddp
