// FullyShardedDataParallel::load_full_state_dict_file: a full state dict file
// (torch.save's zip format, from ddp::save_state_dict or Python) loaded
// straight into the shards, without the whole model in memory.
//
// torch.save stores each storage as an uncompressed record data/<key>, and
// data.pkl says which storage, offset, shape and strides each name has. So a
// rank reads data.pkl (small) with the weights-only unpickler, over storages
// that hold no data, works out where in the file each element of its shard
// lies, and reads just those bytes with pread.

#include <ddp/fully_sharded_data_parallel.h>

#include <ddp/error.h>

#include "common/error_text.h"
#include "sharding/fsdp_runtime.h"
#include "common/shard_range.h"
#include "checkpoint/torch_save_file.h"
#include "checkpoint/weights_only_unpickler.h"

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <c10/util/safe_numerics.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ddp::detail {
namespace {

// A file read with pread only, so readers at different offsets never move a
// shared cursor, and nothing is read that is not asked for.
class PreadFile final : public caffe2::serialize::ReadAdapterInterface {
 public:
  explicit PreadFile(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    DDP_CHECK(fd_ >= 0, "ddp: cannot load '", path, "': ", std::strerror(errno));
    struct stat info {};
    if (::fstat(fd_, &info) != 0 || !S_ISREG(info.st_mode)) {
      ::close(fd_);
      DDP_CHECK(false, "ddp: cannot load '", path, "': it is not a regular file");
    }
    size_ = static_cast<size_t>(info.st_size);
  }
  ~PreadFile() override { ::close(fd_); }
  PreadFile(const PreadFile&) = delete;
  PreadFile& operator=(const PreadFile&) = delete;

  size_t size() const override { return size_; }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    size_t done = 0;
    while (done < n) {
      ssize_t got = ::pread(fd_, static_cast<char*>(buf) + done, n - done, static_cast<off_t>(pos + done));
      if (got < 0 && errno == EINTR) continue;
      DDP_CHECK(got >= 0, "ddp: reading '", path_, "' failed: ", std::strerror(errno));
      if (got == 0) break;
      done += static_cast<size_t>(got);
    }
    return done;
  }

 private:
  std::string path_;
  int fd_ = -1;
  size_t size_ = 0;
};

// Where one tensor of the state dict lies: `sizes` and `strides` over the
// storage in record data/<key>, from element `offset`.
struct TensorLocation {
  std::string key;
  at::ScalarType dtype = at::kFloat;
  int64_t storage_numel = 0;
  int64_t offset = 0;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t size : sizes) n *= size;
    return n;
  }
  bool contiguous() const {
    int64_t expected = 1;
    for (size_t d = sizes.size(); d-- > 0;) {
      if (sizes[d] != 1 && strides[d] != expected) return false;
      expected *= sizes[d];
    }
    return true;
  }
};

// Where each tensor of the state dict in data.pkl lies, without reading any:
// the weights-only unpickler (the same checks as every load) builds the
// tensors over meta storages, whose record keys are noted as they are made.
std::vector<std::pair<std::string, TensorLocation>> index_state_dict(
    const std::string& path, caffe2::serialize::PyTorchStreamReader& archive, const char* pickle, size_t size) {
  std::unordered_map<const c10::StorageImpl*, std::pair<std::string, int64_t>> record_of;  // key, numel
  auto meta_storage = [&](const std::string& key, c10::ScalarType dtype, int64_t numel) {
    at::Tensor storage = at::empty({numel}, at::TensorOptions().dtype(dtype).device(at::kMeta));
    record_of[storage.storage().unsafeGetStorageImpl()] = {key, numel};
    return storage;
  };
  const c10::IValue value = unpickle_weights_only(path, archive, pickle, size, meta_storage);
  DDP_CHECK(value.isGenericDict(), "ddp: cannot load '", path, "': it does not hold a state dict (a dict of tensors)");
  std::vector<std::pair<std::string, TensorLocation>> index;
  for (const auto& item : value.toGenericDict()) {
    DDP_CHECK(item.key().isString() && item.value().isTensor(), "ddp: cannot load '", path,
              "': it is not a state dict: every key must be a string and every value a tensor");
    const at::Tensor& tensor = item.value().toTensor();
    const auto& [key, numel] = record_of.at(tensor.storage().unsafeGetStorageImpl());
    TensorLocation location;
    location.key = key;
    location.dtype = tensor.scalar_type();
    location.storage_numel = numel;
    location.offset = tensor.storage_offset();
    location.sizes = tensor.sizes().vec();
    location.strides = tensor.strides().vec();
    index.emplace_back(item.key().toStringRef(), std::move(location));
  }
  return index;
}

// One tensor's bytes in the file: where its storage's record starts.
class TensorReader {
 public:
  TensorReader(const std::string& path, PreadFile& file, caffe2::serialize::PyTorchStreamReader& archive)
      : path_(path), file_(file), archive_(archive) {}

  // Checks that the record of `location` exists and holds its storage.
  void check(const std::string& name, const TensorLocation& location) {
    const std::string record = "data/" + location.key;
    DDP_CHECK(archive_.hasRecord(record), "ddp: cannot load '", path_, "': the archive lacks the record '", record,
              "' of '", name, "' (the file is incomplete)");
    const uint64_t needed = static_cast<uint64_t>(location.storage_numel) * c10::elementSize(location.dtype);
    DDP_CHECK(archive_.getRecordSize(record) >= needed, "ddp: cannot load '", path_, "': record '", record,
              "' holds ", archive_.getRecordSize(record), " bytes, but '", name, "' needs ", needed);
  }

  // Elements [first, first + count) of the tensor in row-major order, as a
  // 1-D tensor of the file's dtype. Reads those bytes only when the tensor is
  // contiguous in its storage (what state dicts hold); otherwise the span of
  // storage it covers.
  at::Tensor read(const TensorLocation& location, int64_t first, int64_t count) {
    const size_t element = c10::elementSize(location.dtype);
    const uint64_t record_at = record_offset(location.key);
    if (location.contiguous()) {
      at::Tensor out = at::empty({count}, at::TensorOptions().dtype(location.dtype));
      read_exactly(record_at + static_cast<uint64_t>(location.offset + first) * element, out.data_ptr(),
                   static_cast<size_t>(count) * element);
      return out;
    }
    int64_t last = location.offset;
    for (size_t d = 0; d < location.sizes.size(); ++d) last += (location.sizes[d] - 1) * location.strides[d];
    const int64_t span = last - location.offset + 1;
    at::Tensor covered = at::empty({span}, at::TensorOptions().dtype(location.dtype));
    read_exactly(record_at + static_cast<uint64_t>(location.offset) * element, covered.data_ptr(),
                 static_cast<size_t>(span) * element);
    return covered.as_strided(location.sizes, location.strides, 0).reshape({-1}).narrow(0, first, count).clone();
  }

 private:
  uint64_t record_offset(const std::string& key) {
    auto it = offsets_.find(key);
    if (it != offsets_.end()) return it->second;
    return offsets_[key] = archive_.getRecordOffset("data/" + key);
  }
  void read_exactly(uint64_t at, void* buffer, size_t bytes) {
    if (bytes == 0) return;
    DDP_CHECK(file_.read(at, buffer, bytes, "tensor data") == bytes, "ddp: cannot load '", path_,
              "': it ends inside a tensor's data (the file is truncated)");
  }

  const std::string& path_;
  PreadFile& file_;
  caffe2::serialize::PyTorchStreamReader& archive_;
  std::unordered_map<std::string, uint64_t> offsets_;
};

}  // namespace

void FsdpRuntime::load_full_state_dict_file(const std::string& path) {
  auto file = std::make_shared<PreadFile>(path);
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> archive;
  std::vector<std::pair<std::string, TensorLocation>> index;
  try {
    archive = open_torch_save_file(file, path);
    DDP_CHECK(archive->hasRecord("data.pkl"), "ddp: cannot load '", path,
              "': it has no data.pkl record; it is not a torch.save file");
    auto [pickle, pickle_size] = archive->getRecord("data.pkl");
    index = index_state_dict(path, *archive, static_cast<const char*>(pickle.get()), pickle_size);
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    DDP_CHECK(false, "ddp: cannot load '", path, "': ", detail::message_of(e));
  }

  // load_full_state_dict's checks, on the index: every entry the model
  // needs, with its shape, and none extra. Nothing is read before all pass.
  std::map<std::string, const TensorLocation*> by_name;
  for (const auto& [name, location] : index) by_name[name] = &location;
  TensorReader reader(path, *file, *archive);
  auto find = [&](const std::string& name, at::IntArrayRef sizes) -> const TensorLocation& {
    auto it = by_name.find(name);
    DDP_CHECK(it != by_name.end(), "ddp: cannot load '", path, "': the state dict has no entry '", name,
              "' that the model needs");
    DDP_CHECK(at::IntArrayRef(it->second->sizes) == sizes, "ddp: cannot load '", path, "': state dict entry '", name,
              "' has shape ", at::IntArrayRef(it->second->sizes), " but the model's has shape ", sizes);
    reader.check(name, *it->second);
    return *it->second;
  };
  std::map<std::string, bool> needed;
  for (const auto& unit : units_) {
    for (size_t j = 0; j < unit->params.size(); ++j) {
      find(unit->layout.names[j], unit->layout.shapes[j]);
      needed[unit->layout.names[j]] = true;
    }
  }
  const auto replicated_tensors = replicated();
  for (const auto& [name, tensor] : replicated_tensors) {
    find(name, tensor.sizes());
    needed[name] = true;
  }
  for (const auto& [name, location] : index) {
    DDP_CHECK(needed.count(name), "ddp: cannot load '", path, "': the state dict has the entry '", name,
              "' that the model lacks");
  }

  // Each unit's shard: of every parameter, only the elements that fall in
  // this rank's range of the unit's flat tensor. Read into stand-ins first,
  // so that a read error leaves the model as it was.
  std::vector<at::Tensor> shards;
  for (const auto& unit : units_) {
    const ShardRange mine = unit->layout.shard;
    at::Tensor shard = at::zeros({mine.numel()}, unit->shard.options().requires_grad(false));
    for (size_t j = 0; j < unit->params.size(); ++j) {
      const int64_t offset = unit->layout.offsets[j];
      const ShardRange part = clip(mine, {offset, offset + unit->layout.numel_of(j)});
      if (part.empty()) continue;
      at::Tensor piece = reader.read(*by_name.at(unit->layout.names[j]), part.begin - offset, part.numel());
      shard.narrow(0, part.begin - mine.begin, part.numel()).copy_(piece);
    }
    shards.push_back(std::move(shard));
  }
  std::vector<at::Tensor> whole;  // buffers and frozen parameters: every rank keeps them whole
  for (const auto& [name, tensor] : replicated_tensors) {
    const TensorLocation& location = *by_name.at(name);
    whole.push_back(reader.read(location, 0, location.numel()).view(tensor.sizes()));
  }

  at::NoGradGuard no_grad;
  for (size_t u = 0; u < units_.size(); ++u) {
    FsdpUnit& unit = *units_[u];
    unit.shard.detach().copy_(shards[u]);
    // Inside summon_full_params(): the gathered parameters follow the shards.
    unit.regather();
  }
  for (size_t i = 0; i < replicated_tensors.size(); ++i) replicated_tensors[i].second.detach().copy_(whole[i]);
  refresh_frozen_parameters();
}

}  // namespace ddp::detail
