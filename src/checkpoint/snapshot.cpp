#include <ddp/snapshot.h>

#include <ddp/error.h>
#include <ddp/collective_trace.h>

#include "common/error_text.h"
#include "comm/fnv1a.h"
#include "checkpoint/snapshot_retention.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>
#include <ATen/core/Dict.h>
#include <torch/nn/module.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <regex>

namespace fs = std::filesystem;

namespace ddp {
namespace {

using GenericDict = c10::impl::GenericDict;

GenericDict new_dict() { return GenericDict(c10::AnyType::get(), c10::AnyType::get()); }

// FNV-1a over a value's contents, in order: detects corruption the container
// format does not (flipped bits inside a tensor record).
class Checksum {
 public:
  void add(const c10::IValue& v) {
    if (v.isTensor()) {
      at::Tensor t = v.toTensor().to(at::kCPU).contiguous();
      bytes(t.data_ptr(), t.nbytes());
    } else if (v.isGenericDict()) {
      for (const auto& item : v.toGenericDict()) {
        add(item.key());
        add(item.value());
      }
    } else if (v.isList()) {
      for (const auto& item : v.toListRef()) add(item);
    } else if (v.isTuple()) {
      for (const auto& item : v.toTupleRef().elements()) add(item);
    } else if (v.isString()) {
      bytes(v.toStringRef().data(), v.toStringRef().size());
    } else if (v.isInt()) {
      int64_t i = v.toInt();
      bytes(&i, sizeof(i));
    } else if (v.isDouble()) {
      double d = v.toDouble();
      bytes(&d, sizeof(d));
    } else if (v.isBool()) {
      char b = v.toBool();
      bytes(&b, 1);
    }
  }
  int64_t value() const { return static_cast<int64_t>(hash_.value()); }

 private:
  void bytes(const void* data, size_t n) { hash_.add(data, n); }
  detail::Fnv1a hash_;
};

const char* kFormat = "ddp.snapshot";

GenericDict payload_of(const Snapshot& s) {
  GenericDict model(c10::StringType::get(), c10::TensorType::get());
  for (const auto& [name, tensor] : s.model) model.insert(name, tensor.detach().to(at::kCPU).contiguous().clone());
  GenericDict payload = new_dict();
  payload.insert("epoch", s.epoch);
  payload.insert("step", s.step);
  payload.insert("sampler_epoch", s.sampler_epoch);
  payload.insert("model", model);
  payload.insert("optimizer", s.optimizer);
  payload.insert("rng_state", s.rng_state.defined() ? s.rng_state : at::empty({0}, at::kByte));
  payload.insert("extra", s.extra);
  return payload;
}

template <typename... Args>
[[noreturn]] void reject(const std::string& name, const Args&... args) {
  DDP_CHECK(false, "ddp: snapshot '", name, "' is not usable: ", args...);
}

const c10::IValue& field(const GenericDict& dict, const std::string& key, const std::string& name) {
  auto it = dict.find(key);
  if (it == dict.end()) reject(name, "it has no '", key, "' entry");
  return it->value();
}

int64_t integer_field(const GenericDict& dict, const std::string& key, const std::string& name) {
  const auto& value = field(dict, key, name);
  if (!value.isInt()) reject(name, "its '", key, "' entry is not an integer");
  return value.toInt();
}

Snapshot parse_snapshot(const c10::IValue& value, const std::string& name) {
  if (!value.isGenericDict()) reject(name, "it does not hold a dict");
  GenericDict file = value.toGenericDict();
  const auto& format = field(file, "format", name);
  if (!format.isString() || format.toStringRef() != kFormat) reject(name, "it is not a ddp snapshot");
  int64_t version = integer_field(file, "version", name);
  if (version != kSnapshotVersion) {
    reject(name, "it has format version ", version, " but this ddp reads version ", kSnapshotVersion);
  }
  const auto& payload_value = field(file, "payload", name);
  if (!payload_value.isGenericDict()) reject(name, "its payload is not a dict");
  Checksum checksum;
  checksum.add(payload_value);
  if (checksum.value() != integer_field(file, "checksum", name)) {
    reject(name, "its checksum does not match its contents (the file is corrupt)");
  }
  GenericDict payload = payload_value.toGenericDict();
  Snapshot s;
  s.epoch = integer_field(payload, "epoch", name);
  s.step = integer_field(payload, "step", name);
  s.sampler_epoch = integer_field(payload, "sampler_epoch", name);
  for (const auto& item : field(payload, "model", name).toGenericDict()) {
    s.model.emplace_back(item.key().toStringRef(), item.value().toTensor());
  }
  s.optimizer = field(payload, "optimizer", name);
  s.rng_state = field(payload, "rng_state", name).toTensor();
  s.extra = field(payload, "extra", name);
  return s;
}

std::vector<char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  DDP_CHECK(in.good(), "ddp: cannot open snapshot '", path, "': ", std::strerror(errno));
  return std::vector<char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// The snapshot_<epoch>.pt files in `dir`, sorted by name only: which one
// is newest only their validated contents can say (detail::further_along).
std::vector<std::string> snapshot_files(const std::string& dir) {
  std::vector<std::string> files;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return {};
  static const std::regex pattern("snapshot_([0-9]{1,18})\\.pt");
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (std::regex_match(it->path().filename().string(), pattern)) files.push_back(it->path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

// Newest means furthest along (detail::further_along), then the greatest
// name. A directory holds one run; a fresh run wants an empty one.
bool newer(const detail::SnapshotOnDisk& a, const detail::SnapshotOnDisk& b) {
  return detail::further_along(a, b) || (!detail::further_along(b, a) && a.path > b.path);
}

// The model's names and shapes: whether two snapshots are of one model.
std::vector<std::pair<std::string, std::vector<int64_t>>> model_shapes(const Snapshot& s) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  for (const auto& [name, tensor] : s.model) shapes.emplace_back(name, tensor.sizes().vec());
  return shapes;
}

// What a skipped file's entry says: the file and why. Loading names the
// file in its own errors; anything else that escapes gets it added.
std::string why_skipped(const std::string& path, const std::exception& e) {
  const auto* error = dynamic_cast<const c10::Error*>(&e);
  std::string message = error ? error->what_without_backtrace() : e.what();
  if (message.find(path) == std::string::npos) message = "ddp: snapshot '" + path + "' is not usable: " + message;
  return message;
}

}  // namespace

// optimizer_state_dict, is_per_element_state and load_optimizer_state_dict:
// src/checkpoint/optimizer_state.cpp, with the re-layouts ZeRO and FSDP make of them.

Snapshot capture_snapshot(const torch::nn::Module& model, torch::optim::Optimizer& optimizer, int64_t epoch,
                          int64_t step) {
  return capture_snapshot(state_dict(model), optimizer_state_dict(optimizer), epoch, step);
}

Snapshot capture_snapshot(StateDict model, c10::IValue optimizer, int64_t epoch, int64_t step) {
  Snapshot s;
  s.epoch = epoch;
  s.step = step;
  s.sampler_epoch = epoch + 1;
  s.model = std::move(model);
  s.optimizer = std::move(optimizer);
  s.rng_state = at::detail::getDefaultCPUGenerator().get_state();
  return s;
}

void restore_snapshot(const Snapshot& snapshot, torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  load_state_dict(model, snapshot.model);
  load_optimizer_state_dict(optimizer, snapshot.optimizer);
  restore_rng_state(snapshot);
}

void restore_rng_state(const Snapshot& snapshot) {
  if (snapshot.rng_state.defined() && snapshot.rng_state.numel() > 0) {
    at::Generator generator = at::detail::getDefaultCPUGenerator();  // a handle to the global one
    generator.set_state(snapshot.rng_state);
  }
}

void save_snapshot(const Snapshot& snapshot, const std::string& path) {
  GenericDict payload = payload_of(snapshot);
  Checksum checksum;
  checksum.add(payload);
  GenericDict file = new_dict();
  file.insert("format", std::string(kFormat));
  file.insert("version", kSnapshotVersion);
  file.insert("checksum", checksum.value());
  file.insert("payload", payload);
  save_value(file, path);
}

Snapshot load_snapshot(const std::string& path) { return parse_snapshot(load_value(path), path); }

detail::SnapshotListing detail::list_snapshot_files(const std::string& dir, const std::string& written) {
  const Snapshot mine = load_snapshot(written);
  const auto model = model_shapes(mine);
  SnapshotListing listing{{written, mine.step, mine.epoch, true, resumed_from(written)}, {}};
  std::error_code ec;
  for (const auto& path : snapshot_files(dir)) {
    if (fs::equivalent(path, written, ec)) continue;
    SnapshotOnDisk other{path};
    other.resumed_from = resumed_from(path);
    try {
      if (!fs::is_symlink(path)) {
        Snapshot s = load_snapshot(path);
        other.step = s.step;
        other.epoch = s.epoch;
        other.ours = model_shapes(s) == model;
      }
    } catch (const std::exception&) {
      // damaged or not a snapshot: not ours
    }
    listing.others.push_back(std::move(other));
  }
  return listing;
}

std::optional<Snapshot> load_newest_snapshot(const std::string& dir, std::vector<std::string>* skipped) {
  set_trace_fallback_directory(dir);
  std::optional<Snapshot> newest;
  std::optional<detail::SnapshotOnDisk> newest_progress;
  for (const auto& path : snapshot_files(dir)) {
    try {
      Snapshot s = load_snapshot(path);
      detail::SnapshotOnDisk progress{path, s.step, s.epoch};
      if (!newest_progress || newer(progress, *newest_progress)) {
        newest = std::move(s);
        newest_progress = progress;
      }
    } catch (const std::exception& e) {
      if (skipped) skipped->push_back(why_skipped(path, e));
    }
  }
  if (newest_progress) detail::note_resumed_from(newest_progress->path);
  return newest;
}

std::optional<Snapshot> load_newest_snapshot(const std::string& dir, ProcessGroup& group,
                                             std::vector<std::string>* skipped) {
  std::vector<char> bytes;
  std::string name;
  if (group.rank() == 0) {
    // Whatever goes wrong here, rank 0 must still take part in the
    // broadcasts below, or the other ranks would wait for it until timeout.
    try {
      std::optional<detail::SnapshotOnDisk> newest;
      for (const auto& path : snapshot_files(dir)) {
        try {
          // Validated from the very bytes that are sent.
          std::vector<char> candidate = read_bytes(path);
          Snapshot s = parse_snapshot(deserialize_value(candidate, path), path);
          detail::SnapshotOnDisk progress{path, s.step, s.epoch};
          if (!newest || newer(progress, *newest)) {
            newest = progress;
            bytes = std::move(candidate);
            name = path;
          }
        } catch (const std::exception& e) {
          if (skipped) skipped->push_back(why_skipped(path, e));
        }
      }
    } catch (const std::exception& e) {
      bytes.clear();
      if (skipped) {
        skipped->push_back(std::string("ddp: cannot scan '") + dir + "' for snapshots: " + detail::message_of(e));
      }
    }
  }
  CollectiveTag tag("snapshot broadcast");
  at::Tensor size = at::full({1}, static_cast<int64_t>(bytes.size()), group.control_options().dtype(at::kLong));
  group.broadcast(size, 0);
  int64_t n = size.item<int64_t>();
  if (n == 0) return std::nullopt;
  at::Tensor buffer = at::empty({n}, at::kByte);
  if (group.rank() == 0) std::memcpy(buffer.data_ptr(), bytes.data(), bytes.size());
  buffer = group.to_control(buffer);
  group.broadcast(buffer, 0);
  buffer = buffer.cpu();
  if (group.rank() != 0) {
    auto* data = static_cast<const char*>(buffer.data_ptr());
    bytes.assign(data, data + n);
    name = "snapshot from rank 0";
  }
  Snapshot snapshot = parse_snapshot(deserialize_value(bytes, name), name);
  if (group.rank() == 0) detail::note_resumed_from(name);
  return snapshot;
}

}  // namespace ddp
