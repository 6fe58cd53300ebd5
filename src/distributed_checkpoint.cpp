// Distributed checkpoints (include/ddp/distributed_checkpoint.h): which boxes
// of which tensors each rank writes and reads, for FSDP's flat shards and
// for DDP's and ZeRO's replicated model, and the directory's commit. The
// file format is safetensors_io.h.

#include <ddp/distributed_checkpoint.h>

#include <ddp/error.h>
#include <ddp/snapshot.h>

#include "fmt_header_only.h"
#include "optimizer_state.h"
#include "safetensors_io.h"

#include <ATen/Functions.h>
#include <torch/optim/optimizer.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <map>
#include <optional>

#include <fcntl.h>
#include <unistd.h>

namespace ddp::detail {

// The __metadata__ entry of rank 0's first file that holds the optimizer's
// hyperparameters, which safetensors cannot store as tensors.
constexpr const char* kParamGroupsKey = "ddp_param_groups";

namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

std::vector<int64_t> int_list(const c10::IValue& value) {
  std::vector<int64_t> out;
  for (const c10::IValue& item : value.toList()) out.push_back(item.toInt());
  return out;
}

struct Names {
  const DistributedCheckpointOptions& options;
  static std::string join(const std::string& prefix, const std::string& rest) {
    return prefix.empty() ? rest : prefix + "." + rest;
  }
  std::string model(const std::string& fqn) const { return join(options.model_prefix(), fqn); }
  std::string optimizer(const std::string& fqn, const std::string& key) const {
    return join(options.optimizer_prefix(), "state." + fqn + "." + key);
  }
  std::string optimizer_entries(const std::string& fqn) const {
    return join(options.optimizer_prefix(), "state." + fqn + ".");
  }
};

// Elements [begin, end) of the tensor `key` of `shape`, whose element i lies
// at flat[i - flat_first], as boxes that view `flat`.
void add_boxes(std::vector<TensorBox>& out, const std::string& key, const std::vector<int64_t>& shape,
               const at::Tensor& flat, int64_t flat_first, int64_t begin, int64_t end) {
  for (auto& [offsets, sizes] : boxes_of_flat_range(begin, end, shape)) {
    int64_t first = 0;
    for (size_t d = 0; d < shape.size(); ++d) first = first * shape[d] + offsets[d];
    out.push_back(TensorBox{key, offsets, flat.narrow(0, first - flat_first, element_count(sizes)).view(sizes)});
  }
}

// What rank `rank` of `world` writes of `count` elements every rank holds.
std::pair<int64_t, int64_t> even_part(int64_t count, int rank, int world) {
  return {count * rank / world, count * (rank + 1) / world};
}

// A whole tensor that every rank holds: each writes its equal part.
void add_replicated(std::vector<TensorBox>& out, const std::string& key, const at::Tensor& tensor, int rank,
                    int world) {
  at::Tensor flat = tensor.detach().contiguous().view({-1});
  auto [begin, end] = even_part(flat.numel(), rank, world);
  add_boxes(out, key, tensor.sizes().vec(), flat, 0, begin, end);
}

void check_shape(const SafetensorsIndex& index, const std::string& key, at::IntArrayRef shape) {
  const auto stored = index.shape_of(key);
  DDP_CHECK(stored == shape.vec(), "ddp: '", key, "' has shape ", at::IntArrayRef(stored),
            " in the checkpoint but ", shape, " in the model; load a checkpoint of this model");
}

// --- the optimizer's hyperparameters -----------------------------------------

Json param_groups_json(const c10::IValue& optimizer) {
  Json groups = Json::array();
  for (const c10::IValue& group : parse_optimizer_state(optimizer, "save_distributed_checkpoint").param_groups) {
    Json g = Json::object();
    for (const auto& item : group.toGenericDict()) {
      const std::string name = item.key().toStringRef();
      const c10::IValue& v = item.value();
      if (name == "params") continue;
      if (v.isDouble()) g[name] = v.toDouble();
      else if (v.isBool()) g[name] = v.toBool();
      else if (v.isInt()) g[name] = v.toInt();
      else if (v.isTuple()) {
        Json values = Json::array();
        for (const auto& e : v.toTupleRef().elements()) values.push_back(e.toDouble());
        g[name] = values;
      }
    }
    groups.push_back(g);
  }
  return groups;
}

// `current`'s param_groups with the stored hyperparameters put back.
c10::impl::GenericList restored_param_groups(const OptimizerStateParts& current, const std::string& stored) {
  if (stored.empty()) return current.param_groups;
  Json groups = Json::parse(stored, nullptr, false);
  DDP_CHECK(groups.is_array() && groups.size() == current.param_groups.size(), "ddp: the checkpoint's ",
            kParamGroupsKey, " does not match the optimizer's ", current.param_groups.size(), " parameter groups");
  c10::impl::GenericList out(c10::AnyType::get());
  for (size_t i = 0; i < groups.size(); ++i) {
    auto group = current.param_groups.get(i).toGenericDict().copy();
    for (const auto& item : current.param_groups.get(i).toGenericDict()) {
      const std::string name = item.key().toStringRef();
      if (!groups[i].contains(name)) continue;
      const Json& v = groups[i][name];
      const c10::IValue& was = item.value();
      if (was.isDouble() && v.is_number()) group.insert_or_assign(name, v.get<double>());
      else if (was.isBool() && v.is_boolean()) group.insert_or_assign(name, v.get<bool>());
      else if (was.isInt() && v.is_number_integer()) group.insert_or_assign(name, v.get<int64_t>());
      else if (was.isTuple() && v.is_array()) {
        std::vector<c10::IValue> values;
        for (const auto& e : v) values.emplace_back(e.get<double>());
        group.insert_or_assign(name, c10::ivalue::Tuple::create(std::move(values)));
      }
    }
    out.push_back(group);
  }
  return out;
}

// --- the directory -----------------------------------------------------------

void fsync_directory(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// Every rank learns whether every rank succeeded: a failure on one is an
// error on all, instead of the others waiting in a barrier until timeout.
void agree_on_success(ProcessGroup& group, const std::string& error, const char* what) {
  at::Tensor ok = group.to_control(at::scalar_tensor(error.empty() ? 1.0 : 0.0, at::kFloat));
  group.all_reduce(ok, c10d::ReduceOp::MIN);
  DDP_CHECK(error.empty(), error);
  DDP_CHECK(ok.item<double>() == 1.0, "ddp: another rank failed ", what, "; its log says why");
}

// Writes `boxes` as this rank's files of DIR.partial, then, once every rank
// has, makes DIR.partial the checkpoint DIR.
void commit_boxes(const std::string& dir, const std::vector<TensorBox>& boxes,
                  const std::map<std::string, std::string>& rank0_metadata, ProcessGroup& group) {
  DDP_CHECK(!dir.empty(), "ddp: save_distributed_checkpoint needs a directory");
  const std::string target = fs::path(dir).lexically_normal().string();
  const std::string partial = target + ".partial";
  std::string error;
  if (group.rank() == 0) {
    try {
      fs::remove_all(partial);
      fs::create_directories(partial);
    } catch (const std::exception& e) {
      error = std::string("ddp: cannot create '") + partial + "': " + e.what();
    }
  }
  agree_on_success(group, error, "to create the checkpoint directory");

  // The k-th box of each tensor goes to file k.
  std::map<std::string, size_t> seen;
  std::vector<std::vector<TensorBox>> files;
  for (const auto& box : boxes) {
    const size_t k = seen[box.key]++;
    if (files.size() <= k) files.resize(k + 1);
    files[k].push_back(box);
  }
  if (files.empty() && group.rank() == 0) files.resize(1);
  try {
    for (size_t k = 0; k < files.size(); ++k) {
      const std::string name = fmt::format("shard-{:05d}-model-{:05d}-of-{:05d}.safetensors", group.rank() + 1, k + 1,
                                           files.size());
      write_safetensors_file(partial + "/" + name, files[k],
                             k == 0 && group.rank() == 0 ? rank0_metadata : std::map<std::string, std::string>{});
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  agree_on_success(group, error, "to write its part of the checkpoint");

  if (group.rank() == 0) {
    try {
      fsync_directory(partial);
      // DIR is replaced only now that the new one is whole; a crash between
      // the renames leaves DIR.old whole.
      const std::string old = target + ".old";
      fs::remove_all(old);
      if (fs::exists(target)) fs::rename(target, old);
      fs::rename(partial, target);
      fs::remove_all(old);
      fsync_directory(fs::path(target).parent_path().empty() ? "." : fs::path(target).parent_path().string());
    } catch (const std::exception& e) {
      error = std::string("ddp: cannot commit the checkpoint '") + target + "': " + e.what();
    }
  }
  agree_on_success(group, error, "to commit the checkpoint");
}

// An optimizer was given to load: the checkpoint must hold its state (its
// entries, or at least its hyperparameters when saved before any step).
void check_has_optimizer_state(const SafetensorsIndex& index, const Names& names, const std::string& dir) {
  DDP_CHECK(!index.keys_with_prefix(Names::join(names.options.optimizer_prefix(), "state.")).empty() ||
                !index.metadata(kParamGroupsKey).empty(),
            "ddp: the checkpoint in '", dir, "' holds no optimizer state under '", names.options.optimizer_prefix(),
            "'; load it without the optimizer, or set DistributedCheckpointOptions::optimizer_prefix");
}

DistributedCheckpointReport report_of(const SafetensorsIndex& index) {
  DistributedCheckpointReport report;
  report.bytes_read = index.bytes_read();
  report.checkpoint_bytes = index.data_bytes();
  return report;
}

// What rank 0 stores in its first file: the options' strings and the
// optimizer's hyperparameters.
std::map<std::string, std::string> rank0_metadata(const c10::IValue& optimizer,
                                                  const DistributedCheckpointOptions& options) {
  auto metadata = options.metadata();
  if (!optimizer.isNone()) metadata[kParamGroupsKey] = param_groups_json(optimizer).dump();
  return metadata;
}

// --- FSDP ---------------------------------------------------------------------

struct UnitLayout {
  std::vector<std::string> names;
  std::vector<int64_t> offsets;
  std::vector<std::vector<int64_t>> shapes;
  int64_t padded = 0;
  int64_t shard_start = 0;
  at::Tensor shard;
};

UnitLayout unit_layout(const c10::IValue& entry_value) {
  auto entry = entry_value.toGenericDict();
  DDP_CHECK(entry.contains("offsets"), "ddp: this FSDP sharded state dict has no layout; build it with this version");
  UnitLayout unit;
  for (const c10::IValue& n : entry.at("param_names").toList()) unit.names.push_back(n.toStringRef());
  unit.offsets = int_list(entry.at("offsets"));
  for (const c10::IValue& s : entry.at("shapes").toList()) unit.shapes.push_back(int_list(s));
  unit.padded = entry.at("padded").toInt();
  unit.shard_start = entry.at("shard_start").toInt();
  unit.shard = entry.at("shard").toTensor();
  return unit;
}

// The boxes of a unit's flat tensor `flat` (this rank's elements
// [held_start, held_start + flat.numel()) of the unit) that lie in
// [begin, end), per parameter, under `key_of(parameter)`.
template <typename KeyOf>
void add_unit_boxes(std::vector<TensorBox>& out, const UnitLayout& unit, const at::Tensor& flat, int64_t begin,
                    int64_t end, KeyOf key_of) {
  for (size_t j = 0; j < unit.names.size(); ++j) {
    const int64_t first = unit.offsets[j];
    const int64_t count = element_count(unit.shapes[j]);
    const int64_t from = std::max(begin, first), to = std::min(end, first + count);
    if (from >= to) continue;
    add_boxes(out, key_of(j), unit.shapes[j], flat, unit.shard_start - first, from - first, to - first);
  }
}

// The part of the unit this rank writes: under NO_SHARD (every rank holds
// the whole flat tensor) an equal part of it; else its shard, or under HSDP,
// where `replicas` ranks hold the same shard, this replica's equal part of it.
std::pair<int64_t, int64_t> written_range(const UnitLayout& unit, int rank, int world, int replica, int replicas) {
  const int64_t held = unit.shard.numel();
  if (held == unit.padded && world > 1) return even_part(unit.padded, rank, world);
  const auto [begin, end] = even_part(held, replica, replicas);
  return {unit.shard_start + begin, unit.shard_start + end};
}

}  // namespace

void save_fsdp_checkpoint(const std::string& dir, const c10::IValue& sharded, ProcessGroup& group,
                          const DistributedCheckpointOptions& options) {
  const Names names{options};
  auto dict = sharded.toGenericDict();
  const int rank = group.rank(), world = group.size();
  std::vector<TensorBox> boxes;
  c10::IValue optimizer = dict.contains("optimizer") ? dict.at("optimizer") : c10::IValue();
  std::optional<OptimizerStateParts> optim;
  if (!optimizer.isNone()) optim = parse_optimizer_state(optimizer, "save_distributed_checkpoint");
  const int replica = dict.contains("replica") ? static_cast<int>(dict.at("replica").toInt()) : 0;
  const int replicas = dict.contains("replicas") ? static_cast<int>(dict.at("replicas").toInt()) : 1;
  auto units = dict.at("units").toList();
  for (size_t u = 0; u < units.size(); ++u) {
    const UnitLayout unit = unit_layout(units.get(u));
    const auto [begin, end] = written_range(unit, rank, world, replica, replicas);
    add_unit_boxes(boxes, unit, unit.shard, begin, end, [&](size_t j) { return names.model(unit.names[j]); });
    if (!optim) continue;
    auto found = optim->state.find(static_cast<int64_t>(u));
    if (found == optim->state.end()) continue;  // not stepped yet
    for (const auto& item : found->value().toGenericDict()) {
      const std::string key = item.key().toStringRef();
      if (is_per_element_state(key)) {
        const at::Tensor flat = item.value().toTensor();
        add_unit_boxes(boxes, unit, flat, begin, end, [&](size_t j) { return names.optimizer(unit.names[j], key); });
      } else {
        // One value for the whole unit ("step"): written once per
        // parameter, by the rank that writes its first element.
        for (size_t j = 0; j < unit.names.size(); ++j) {
          if (unit.offsets[j] >= begin && unit.offsets[j] < end && element_count(unit.shapes[j]) > 0) {
            boxes.push_back(TensorBox{names.optimizer(unit.names[j], key), {}, item.value().toTensor().detach().clone()});
          }
        }
      }
    }
  }
  for (const auto& item : dict.at("buffers").toGenericDict()) {
    add_replicated(boxes, names.model(item.key().toStringRef()), item.value().toTensor(), rank, world);
  }
  commit_boxes(dir, boxes, rank == 0 ? rank0_metadata(optimizer, options) : std::map<std::string, std::string>{},
               group);
}

c10::IValue read_fsdp_checkpoint(const std::string& dir, const c10::IValue& sharded, bool with_optimizer,
                                 const DistributedCheckpointOptions& options, DistributedCheckpointReport* report) {
  const Names names{options};
  SafetensorsIndex index(dir);
  auto dict = sharded.toGenericDict().copy();
  auto units = dict.at("units").toList();
  std::vector<TensorBox> boxes;
  auto optim_state = new_generic_dict();
  std::vector<std::pair<int64_t, std::string>> steps;  // (unit, the key of its step)
  for (size_t u = 0; u < units.size(); ++u) {
    const UnitLayout unit = unit_layout(units.get(u));
    const int64_t begin = unit.shard_start, end = unit.shard_start + unit.shard.numel();
    for (size_t j = 0; j < unit.names.size(); ++j) check_shape(index, names.model(unit.names[j]), unit.shapes[j]);
    // The shard in the state dict is a copy: fill it, padding zeroed.
    unit.shard.zero_();
    add_unit_boxes(boxes, unit, unit.shard, begin, end, [&](size_t j) { return names.model(unit.names[j]); });
    if (!with_optimizer) continue;
    // The unit's optimizer entries are those its first parameter has; all
    // its parameters must have the same.
    std::vector<std::string> keys;
    for (const auto& key : index.keys_with_prefix(names.optimizer_entries(unit.names[0]))) {
      const std::string rest = key.substr(names.optimizer_entries(unit.names[0]).size());
      if (rest.find('.') == std::string::npos) keys.push_back(rest);
    }
    if (keys.empty()) continue;  // saved before the optimizer stepped
    auto entry = new_generic_dict();
    for (const auto& key : keys) {
      for (const auto& name : unit.names) {
        DDP_CHECK(index.contains(names.optimizer(name, key)), "ddp: the checkpoint has optimizer state '", key,
                  "' for '", unit.names[0], "' but not for '", name, "'; FSDP needs it for every parameter of a unit");
      }
      if (is_per_element_state(key)) {
        for (size_t j = 0; j < unit.names.size(); ++j) {
          check_shape(index, names.optimizer(unit.names[j], key), unit.shapes[j]);
        }
        at::Tensor flat = at::zeros_like(unit.shard);
        add_unit_boxes(boxes, unit, flat, begin, end, [&](size_t j) { return names.optimizer(unit.names[j], key); });
        entry.insert(key, flat);
      } else {
        at::Tensor value = at::zeros({}, at::kFloat);
        boxes.push_back(TensorBox{names.optimizer(unit.names[0], key), {}, value});
        entry.insert(key, value);
      }
    }
    optim_state.insert(static_cast<int64_t>(u), entry);
  }
  auto buffers = dict.at("buffers").toGenericDict();
  for (const auto& item : buffers) {
    const std::string key = names.model(item.key().toStringRef());
    at::Tensor target = item.value().toTensor();
    check_shape(index, key, target.sizes());
    boxes.push_back(TensorBox{key, std::vector<int64_t>(target.dim(), 0), target});
  }
  for (auto& box : boxes) index.read_into(box);

  if (with_optimizer) {
    check_has_optimizer_state(index, names, dir);
    DDP_CHECK(dict.contains("optimizer"), "ddp: load_distributed_checkpoint was given no optimizer state to fill");
    auto current = parse_optimizer_state(dict.at("optimizer"), "load_distributed_checkpoint");
    dict.insert_or_assign("optimizer",
                          make_optimizer_state(optim_state, restored_param_groups(current, index.metadata(kParamGroupsKey))));
  }
  if (report) *report = report_of(index);
  return dict;
}

// --- DDP and ZeRO ---------------------------------------------------------------

std::vector<int64_t> all_indices(const torch::nn::Module& module) {
  std::vector<int64_t> indices(module.named_parameters(true).size());
  for (size_t i = 0; i < indices.size(); ++i) indices[i] = static_cast<int64_t>(i);
  return indices;
}

c10::IValue optimizer_state_or_none(torch::optim::Optimizer* optimizer) {
  return optimizer ? optimizer_state_dict(*optimizer) : c10::IValue();
}

void load_optimizer_state_or_none(torch::optim::Optimizer* optimizer, const c10::IValue& state) {
  if (optimizer) load_optimizer_state_dict(*optimizer, state);
}

void save_replicated_checkpoint(const std::string& dir, const torch::nn::Module& module, const c10::IValue& optimizer,
                                const std::vector<int64_t>& owned, bool sharded_optimizer, ProcessGroup& group,
                                const DistributedCheckpointOptions& options) {
  const Names names{options};
  const int rank = group.rank(), world = group.size();
  std::vector<TensorBox> boxes;
  for (const auto& [name, tensor] : ddp::state_dict(module)) add_replicated(boxes, names.model(name), tensor, rank, world);
  if (!optimizer.isNone()) {
    const auto params = module.named_parameters(true);
    auto parts = parse_optimizer_state(optimizer, "save_distributed_checkpoint");
    for (const auto& item : parts.state) {
      const int64_t position = item.key().toInt();
      DDP_CHECK(position >= 0 && position < static_cast<int64_t>(owned.size()), "ddp: the optimizer has state for ",
                "parameter ", position, " but is built over ", owned.size(), "; build it over model.parameters()");
      const std::string fqn = params[owned[position]].key();
      for (const auto& entry : item.value().toGenericDict()) {
        const std::string key = names.optimizer(fqn, entry.key().toStringRef());
        const at::Tensor value = entry.value().toTensor();
        if (sharded_optimizer) boxes.push_back(TensorBox{key, std::vector<int64_t>(value.dim(), 0), value.detach()});
        else add_replicated(boxes, key, value, rank, world);
      }
    }
  }
  commit_boxes(dir, boxes, rank == 0 ? rank0_metadata(optimizer, options) : std::map<std::string, std::string>{},
               group);
}

c10::IValue load_replicated_checkpoint(const std::string& dir, torch::nn::Module& module, const c10::IValue& optimizer,
                                       const std::vector<int64_t>& owned, const DistributedCheckpointOptions& options,
                                       DistributedCheckpointReport* report) {
  const Names names{options};
  SafetensorsIndex index(dir);
  // Read into copies: the module changes only once everything has been read.
  std::vector<std::pair<at::Tensor, TensorBox>> model;
  for (const auto& [name, tensor] : ddp::state_dict(module)) {
    const std::string key = names.model(name);
    check_shape(index, key, tensor.sizes());
    model.emplace_back(tensor, TensorBox{key, std::vector<int64_t>(tensor.dim(), 0), at::empty_like(tensor)});
  }
  for (auto& [tensor, box] : model) index.read_into(box);

  c10::IValue result;
  if (!optimizer.isNone()) {
    check_has_optimizer_state(index, names, dir);
    const auto params = module.named_parameters(true);
    auto current = parse_optimizer_state(optimizer, "load_distributed_checkpoint");
    auto state = new_generic_dict();
    for (size_t position = 0; position < owned.size(); ++position) {
      const std::string fqn = params[owned[position]].key();
      const at::Tensor& param = params[owned[position]].value();
      auto entry = new_generic_dict();
      for (const auto& key : index.keys_with_prefix(names.optimizer_entries(fqn))) {
        const std::string name = key.substr(names.optimizer_entries(fqn).size());
        if (name.find('.') != std::string::npos) continue;
        TensorBox box{key, {}, {}};
        if (is_per_element_state(name)) {
          check_shape(index, key, param.sizes());
          box.data = at::empty_like(param.detach(), param.options().requires_grad(false));
        } else {
          box.data = at::zeros({}, at::kFloat);
        }
        box.offsets.assign(box.data.dim(), 0);
        index.read_into(box);
        entry.insert(name, box.data);
      }
      if (entry.size() > 0) state.insert(static_cast<int64_t>(position), entry);
    }
    result = make_optimizer_state(state, restored_param_groups(current, index.metadata(kParamGroupsKey)));
  }
  at::NoGradGuard no_grad;
  for (auto& [tensor, box] : model) tensor.detach().copy_(box.data);
  if (report) *report = report_of(index);
  return result;
}

}  // namespace ddp::detail

namespace ddp {

std::map<std::string, std::string> distributed_checkpoint_metadata(const std::string& dir) {
  auto metadata = detail::SafetensorsIndex(dir).all_metadata();
  // DCP's own entries and the hyperparameters are not the program's.
  for (const char* own : {"DCP_VERSION", "format", detail::kParamGroupsKey}) metadata.erase(own);
  return metadata;
}

}  // namespace ddp
