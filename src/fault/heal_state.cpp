// The state a joiner receives, listed tensor by tensor so that it can be
// split across senders (heal_state.h).

#include "fault/heal_state.h"

#include <ddp/error.h>

#include <ATen/Functions.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <numeric>
#include <sstream>

namespace ddp::detail {
namespace {

using torch::serialize::InputArchive;
using torch::serialize::OutputArchive;

// Tensors of the optimizer's archive smaller than this travel inside the
// skeleton rather than in the shards.
constexpr size_t kInlineBytes = 1024;

// Calls `visit` on every tensor of `in`, keys in sorted order, sub-archives
// recursively; with `out`, writes `in` there with each tensor replaced by
// what `visit` returns. Paths join keys with '|' (keys hold '/').
using Visit = std::function<at::Tensor(const std::string& path, const at::Tensor& tensor)>;
void rewrite(InputArchive& in, OutputArchive* out, const std::string& prefix, const Visit& visit) {
  std::vector<std::string> keys = in.keys();
  std::sort(keys.begin(), keys.end());
  for (const auto& key : keys) {
    const std::string path = prefix.empty() ? key : prefix + "|" + key;
    InputArchive sub;
    if (in.try_read(key, sub)) {
      if (out) {
        OutputArchive sub_out(out->compilation_unit());
        rewrite(sub, &sub_out, path, visit);
        out->write(key, sub_out);
      } else {
        rewrite(sub, nullptr, path, visit);
      }
      continue;
    }
    c10::IValue value;
    in.read(key, value);
    if (value.isTensor()) {
      at::Tensor replaced = visit(path, value.toTensor());
      if (out) out->write(key, c10::IValue(replaced));
    } else if (out) {
      out->write(key, value);
    }
  }
}

// torch keys an optimizer's state by its parameters' addresses, which differ
// between processes; the parameter's place in the groups does not.
std::map<std::string, std::string> parameter_places(const torch::optim::Optimizer& optimizer) {
  std::map<std::string, std::string> places;
  const auto& groups = optimizer.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& params = groups[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      places[std::to_string(reinterpret_cast<size_t>(params[i].unsafeGetTensorImpl()))] =
          "p" + std::to_string(g) + "." + std::to_string(i);
    }
  }
  return places;
}

std::string canonical_path(const std::string& raw, const std::map<std::string, std::string>& places) {
  std::string name = "optimizer";
  std::stringstream in(raw);
  for (std::string key; std::getline(in, key, '|');) {
    auto it = places.find(key);
    name += "|" + (it == places.end() ? key : it->second);
  }
  return name;
}

uint64_t fingerprint_of(const HealTensors& h) {
  uint64_t f = 1469598103934665603ULL;
  auto mix = [&](const void* data, size_t n) {
    const auto* bytes = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < n; ++i) f = (f ^ bytes[i]) * 1099511628211ULL;
  };
  for (size_t i = 0; i < h.names.size(); ++i) {
    mix(h.names[i].data(), h.names[i].size() + 1);
    const int8_t dtype = static_cast<int8_t>(h.tensors[i].scalar_type());
    mix(&dtype, 1);
    for (int64_t d : h.tensors[i].sizes()) mix(&d, sizeof d);
  }
  return f;
}

// Puts the entries in canonical (name) order and fingerprints them.
void finish(HealTensors& h) {
  std::vector<size_t> order(h.names.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return h.names[a] < h.names[b]; });
  HealTensors sorted;
  for (size_t i : order) {
    sorted.names.push_back(h.names[i]);
    sorted.tensors.push_back(h.tensors[i]);
    sorted.raw_paths.push_back(h.raw_paths[i]);
  }
  for (size_t i = 1; i < sorted.names.size(); ++i) {
    DDP_CHECK(sorted.names[i] != sorted.names[i - 1], "ddp: two tensors of the state for joiners share the name '",
              sorted.names[i], "'; give the module's parameters and buffers distinct names");
  }
  h = std::move(sorted);
  h.fingerprint = fingerprint_of(h);
}

void add_buffers(torch::nn::Module& module, HealTensors& h, bool copy) {
  for (const auto& b : module.named_buffers()) {
    if (!b.value().defined()) continue;
    h.names.push_back("model|" + b.key() + "|buffer");
    h.tensors.push_back(copy ? b.value().detach().contiguous() : b.value().detach());
    h.raw_paths.emplace_back();
  }
}

void add_module(torch::nn::Module& module, HealTensors& h, bool copy) {
  for (const auto& p : module.named_parameters()) {
    h.names.push_back("model|" + p.key());
    h.tensors.push_back(copy ? p.value().detach().contiguous() : p.value().detach());
    h.raw_paths.emplace_back();
  }
  add_buffers(module, h, copy);
}

}  // namespace

std::vector<int> assign_to_senders(const std::vector<int64_t>& bytes, int senders) {
  DDP_CHECK(senders >= 1, "ddp: healing needs at least one sender, got ", senders);
  std::vector<size_t> order(bytes.size());
  std::iota(order.begin(), order.end(), 0);
  // Largest first; equal sizes keep their order, so the plan is the same everywhere.
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return bytes[a] > bytes[b]; });
  std::vector<int64_t> load(static_cast<size_t>(senders), 0);
  std::vector<int> plan(bytes.size(), 0);
  for (size_t i : order) {
    const int s = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    plan[i] = s;
    load[static_cast<size_t>(s)] += bytes[i];
  }
  return plan;
}

std::vector<int64_t> HealTensors::bytes() const {
  std::vector<int64_t> b;
  for (const auto& t : tensors) b.push_back(static_cast<int64_t>(t.nbytes()));
  return b;
}

HealTensors list_heal_tensors(torch::nn::Module* module, torch::optim::Optimizer* optimizer,
                              torch::serialize::OutputArchive* skeleton) {
  HealTensors h;
  if (module) add_module(*module, h, /*copy=*/true);
  if (optimizer) {
    OutputArchive saved;
    optimizer->save(saved);
    std::ostringstream bytes;
    saved.save_to(bytes);
    const std::string blob = bytes.str();
    InputArchive archive;
    archive.load_from(blob.data(), blob.size());
    const auto places = parameter_places(*optimizer);
    rewrite(archive, skeleton, "", [&](const std::string& path, const at::Tensor& t) {
      // Counters and sizes stay in the skeleton, from rank 0: not worth a plan.
      if (t.nbytes() < kInlineBytes) return t;
      h.names.push_back(canonical_path(path, places));
      h.tensors.push_back(t.detach().contiguous());
      h.raw_paths.push_back(path);
      // Zero strides: the shape and dtype travel, not the data.
      return at::zeros({}, t.options().requires_grad(false)).expand(t.sizes());
    });
  }
  finish(h);
  return h;
}

HealTensors module_buffers(torch::nn::Module& module) {
  HealTensors h;
  add_buffers(module, h, /*copy=*/false);
  finish(h);
  return h;
}

HealTensors joiner_heal_tensors(torch::nn::Module* module, torch::serialize::InputArchive* skeleton,
                                const std::vector<std::string>& names, const std::vector<std::string>& raw_paths) {
  DDP_CHECK(names.size() == raw_paths.size(), "ddp: the state for joiners lists ", names.size(), " names but ",
            raw_paths.size(), " paths");
  HealTensors h;
  if (module) add_module(*module, h, /*copy=*/false);
  if (skeleton) {
    std::map<std::string, size_t> index;
    for (size_t i = 0; i < raw_paths.size(); ++i) index[raw_paths[i]] = i;
    torch::NoGradGuard no_grad;
    rewrite(*skeleton, nullptr, "", [&](const std::string& path, const at::Tensor& placeholder) {
      auto it = index.find(path);
      if (it == index.end()) return placeholder;  // small: sent whole in the skeleton
      // The skeleton's own tensor gets storage of its shape, in place: the
      // optimizer then loads the skeleton itself, no second archive.
      at::Tensor t = placeholder;
      t.set_(at::empty(placeholder.sizes(), placeholder.options()));
      h.names.push_back(names[it->second]);
      h.tensors.push_back(t);
      h.raw_paths.push_back(path);
      return placeholder;
    });
  }
  finish(h);
  return h;
}

int64_t shard_bytes(const HealTensors& held, const std::vector<int>& plan, int sender) {
  int64_t total = 8;
  for (size_t i = 0; i < held.tensors.size(); ++i) {
    if (plan[i] == sender) total += static_cast<int64_t>(held.tensors[i].nbytes());
  }
  return total;
}

at::Tensor pack_shard(const HealTensors& held, const std::vector<int>& plan, int sender) {
  at::Tensor shard = at::empty({shard_bytes(held, plan, sender)}, at::kByte);
  auto* out = static_cast<char*>(shard.data_ptr());
  std::memcpy(out, &held.fingerprint, 8);
  size_t offset = 8;
  for (size_t i = 0; i < held.tensors.size(); ++i) {
    if (plan[i] != sender) continue;
    const size_t n = held.tensors[i].nbytes();
    if (n > 0) std::memcpy(out + offset, held.tensors[i].contiguous().data_ptr(), n);
    offset += n;
  }
  return shard;
}

void unpack_shard(const at::Tensor& shard, HealTensors& into, const std::vector<int>& plan, int sender,
                  const std::string& sender_id) {
  const auto* in = static_cast<const char*>(shard.data_ptr());
  uint64_t theirs = 0;
  std::memcpy(&theirs, in, 8);
  DDP_CHECK(theirs == into.fingerprint, "ddp: replica ", sender_id, " holds a state of other tensors (names, shapes "
            "or dtypes) than this replica expects; every replica must run the same model and optimizer");
  size_t offset = 8;
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < into.tensors.size(); ++i) {
    if (plan[i] != sender) continue;
    at::Tensor& t = into.tensors[i];
    const size_t n = t.nbytes();
    if (n > 0) {
      // Copied into the tensors the module (and DDP) already hold.
      t.copy_(at::from_blob(const_cast<char*>(in + offset), t.sizes(), at::TensorOptions().dtype(t.scalar_type())));
    }
    offset += n;
  }
}

}  // namespace ddp::detail
