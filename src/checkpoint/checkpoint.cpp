#include <ddp/checkpoint.h>

#include <ddp/error.h>

#include "common/atomic_file.h"
#include "common/error_text.h"
#include "checkpoint/torch_save_file.h"
#include "checkpoint/weights_only_unpickler.h"

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <caffe2/serialize/file_adapter.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <random>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>

namespace ddp {
namespace {

// ---------------------------------------------------------------------------
// Atomic files

void write_all(int fd, const char* data, size_t size, const std::string& path) {
  while (size > 0) {
    ssize_t n = ::write(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    DDP_CHECK(n > 0, "ddp: writing '", path, "' failed: ", std::strerror(errno),
              "; check the disk has space and the directory is writable");
    data += n;
    size -= static_cast<size_t>(n);
  }
}

std::string directory_of(const std::string& path) {
  auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// Removes the temporaries that killed writers left in `dir`: files named
// like ours, "<name>.tmp.<pid>.<random>" (or "<name>.tmp.<pid>" from older
// versions), whose process is gone. A temporary is kept while its pid is
// alive on this host (kill(pid, 0)), and while any writer holds its lock
// (writers lock their temporary until the rename), which also protects a
// writer on another host that shares the directory.
void remove_stale_temporaries(const std::string& dir) {
  DIR* directory = ::opendir(dir.c_str());
  if (directory == nullptr) return;
  const pid_t self = ::getpid();
  while (dirent* entry = ::readdir(directory)) {
    std::string name = entry->d_name;
    size_t marker = name.rfind(".tmp.");
    if (marker == std::string::npos || marker == 0) continue;
    std::string digits = name.substr(marker + 5);
    digits = digits.substr(0, digits.find('.'));
    if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    pid_t pid = static_cast<pid_t>(std::stol(digits));
    if (pid <= 0 || pid == self) continue;
    if (::kill(pid, 0) == 0 || errno != ESRCH) continue;  // alive (or not ours to judge)
    std::string path = dir + "/" + name;
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) continue;
    struct stat info {};
    bool stale = ::fstat(fd, &info) == 0 && S_ISREG(info.st_mode) && ::flock(fd, LOCK_EX | LOCK_NB) == 0;
    if (stale) ::unlink(path.c_str());
    ::close(fd);
  }
  ::closedir(directory);
}

// A path that is a symbolic link is refused rather than replaced: it was
// not put there by ddp, which never writes links, so it is someone's plant
// or a user's mistake, and either way the user should hear of it.
void refuse_symbolic_link(const std::string& path) {
  struct stat info {};
  if (::lstat(path.c_str(), &info) != 0 || !S_ISLNK(info.st_mode)) return;
  std::string target(4096, '\0');
  ssize_t n = ::readlink(path.c_str(), target.data(), target.size());
  target.resize(n > 0 ? static_cast<size_t>(n) : 0);
  DDP_CHECK(false, "ddp: refusing to save to '", path, "': it is a symbolic link (to '", target,
            "'), and ddp never writes through a link, since anyone who can write into the directory could point one ",
            "at another file. Remove the link, or save to the real path");
}

// A fresh temporary next to `path`, under a name nobody can guess and
// created only if nothing is there: a planted file or link makes O_EXCL
// fail instead of being followed, and another name is tried.
std::pair<int, std::string> create_temporary(const std::string& path) {
  std::random_device entropy;
  const std::string prefix = path + ".tmp." + std::to_string(::getpid()) + ".";
  std::string temporary;
  for (int attempt = 0; attempt < 64; ++attempt) {
    char suffix[9];
    std::snprintf(suffix, sizeof suffix, "%08x", static_cast<unsigned>(entropy()));
    temporary = prefix + suffix;
    int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd >= 0) return {fd, temporary};
    if (errno != EEXIST) break;
  }
  DDP_CHECK(false, "ddp: cannot create '", temporary, "': ", std::strerror(errno),
            " (does the directory exist and is it writable?)");
  return {-1, ""};
}

}  // namespace

namespace detail {

void write_file_atomically(const std::string& path, const std::function<void(const ByteSink&)>& write) {
  refuse_symbolic_link(path);
  auto [fd, temporary] = create_temporary(path);
  // Held until the temporary is renamed or removed: it tells
  // remove_stale_temporaries that a writer is still at work on it.
  ::flock(fd, LOCK_EX | LOCK_NB);
  try {
    write([fd = fd, &temporary = temporary](const char* data, size_t size) { write_all(fd, data, size, temporary); });
    DDP_CHECK(::fsync(fd) == 0, "ddp: fsync of '", temporary, "' failed: ", std::strerror(errno));
  } catch (...) {
    ::close(fd);
    ::unlink(temporary.c_str());
    throw;
  }
  ::close(fd);
  if (::rename(temporary.c_str(), path.c_str()) != 0) {
    int saved = errno;
    ::unlink(temporary.c_str());
    DDP_CHECK(false, "ddp: cannot rename '", temporary, "' to '", path, "': ", std::strerror(saved));
  }
  // The rename is durable only once the directory entry is on disk.
  int dir = ::open(directory_of(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
  // A successful save is when leftovers of killed runs go.
  remove_stale_temporaries(directory_of(path));
}

}  // namespace detail

void write_file_atomically(const std::string& path, const std::vector<char>& bytes) {
  detail::write_file_atomically(path, [&](const detail::ByteSink& sink) { sink(bytes.data(), bytes.size()); });
}

namespace {

// `value` with every list an untyped one. torch's Pickler writes a typed
// list (of ints, floats, bools or tensors) as a call of torch.jit._pickle's
// builders, which Python's weights-only torch.load refuses; untyped lists
// are plain pickle lists. Dicts' values become untyped for the same reason.
c10::IValue portable(const c10::IValue& value) {
  if (value.isList()) {
    c10::impl::GenericList list(c10::AnyType::get());
    list.reserve(value.toListRef().size());
    for (const c10::IValue& item : value.toListRef()) list.push_back(portable(item));
    return list;
  }
  if (value.isTuple()) {
    std::vector<c10::IValue> items;
    for (const c10::IValue& item : value.toTupleRef().elements()) items.push_back(portable(item));
    return c10::ivalue::Tuple::create(std::move(items));
  }
  if (value.isGenericDict()) {
    c10::impl::GenericDict dict(value.toGenericDict().keyType(), c10::AnyType::get());
    for (const auto& entry : value.toGenericDict()) dict.insert(entry.key(), portable(entry.value()));
    return dict;
  }
  return value;
}

// A tensor's bytes, whatever its layout (nbytes() needs a storage).
int64_t byte_size(const at::Tensor& tensor) {
  return tensor.defined() ? tensor.numel() * static_cast<int64_t>(tensor.element_size()) : 0;
}

// The bytes of the tensors in `value`, for messages about a save's size.
int64_t tensor_bytes(const c10::IValue& value) {
  if (value.isTensor()) return byte_size(value.toTensor());
  int64_t total = 0;
  if (value.isList()) {
    for (const c10::IValue& item : value.toListRef()) total += tensor_bytes(item);
  } else if (value.isTuple()) {
    for (const c10::IValue& item : value.toTupleRef().elements()) total += tensor_bytes(item);
  } else if (value.isGenericDict()) {
    for (const auto& entry : value.toGenericDict()) total += tensor_bytes(entry.value());
  }
  return total;
}

// save_value's file, streamed into `sink` as the zip is made, so a save
// needs no second copy of the tensors in memory.
void write_value(const c10::IValue& value, const detail::ByteSink& sink) {
  std::vector<char> pickle;
  // Untagged aggregates: tagged ones name torch.jit globals that Python's
  // weights_only loader rejects.
  torch::jit::Pickler pickler(
      [&](const char* bytes, size_t n) { pickle.insert(pickle.end(), bytes, bytes + n); },
      /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
      /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(portable(value));
  pickler.stop();

  // The writer's destructor finishes the zip if nobody did, and an
  // exception escaping it is std::terminate. So the sink's first failure is
  // kept and everything after it dropped, and on any error the zip is
  // finished here, where its own failure can be caught.
  std::exception_ptr failure;
  bool abandoned = false;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* bytes, size_t n) -> size_t {
    if (failure || abandoned) return n;
    try {
      sink(static_cast<const char*>(bytes), n);
    } catch (...) {
      failure = std::current_exception();
    }
    return n;
  });
  try {
    torch::jit::writeArchiveAndTensors("data", pickle.data(), pickle.size(), pickler.tensorData(), writer);
    writer.writeEndOfFile();
  } catch (...) {
    abandoned = true;
    if (!writer.finalized()) {
      try {
        writer.writeEndOfFile();
      } catch (...) {
      }
    }
    if (failure) std::rethrow_exception(failure);
    throw;
  }
  if (failure) std::rethrow_exception(failure);
}

// LibTorch's CPU allocator reports a failed allocation as a plain c10::Error
// ("DefaultCPUAllocator: can't allocate memory" or "not enough memory").
bool is_out_of_memory(const c10::Error& e) {
  const std::string what = e.what_without_backtrace();
  return dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr ||
         (what.find("DefaultCPUAllocator") != std::string::npos &&
          (what.find("can't allocate memory") != std::string::npos ||
           what.find("not enough memory") != std::string::npos));
}

[[noreturn]] void fail_out_of_memory(const std::string& path, int64_t bytes) {
  detail::throw_error(c10::str(
      "ddp: ran out of memory while saving '", path, "' (", bytes,
      " bytes of tensors); nothing was written there. Free memory (or raise the process's memory limit, ",
      "ulimit -v), or save a sharded checkpoint, in which each rank writes only its part ",
      "(ddp::save_distributed_checkpoint)"));
}

// Runs `save`, turning an allocation failure (std::bad_alloc, or LibTorch's
// CPU allocator's error) into an error that names the file and the size.
template <typename Save>
void naming_the_file_if_out_of_memory(const std::string& path, int64_t bytes, const Save& save) {
  try {
    save();
  } catch (const std::bad_alloc&) {
    fail_out_of_memory(path, bytes);
  } catch (const ddp::Error&) {
    throw;
  } catch (const c10::Error& e) {
    if (is_out_of_memory(e)) fail_out_of_memory(path, bytes);
    throw;
  }
}

}  // namespace

std::vector<char> serialize_value(const c10::IValue& value) {
  std::vector<char> archive;
  write_value(value, [&](const char* bytes, size_t n) { archive.insert(archive.end(), bytes, bytes + n); });
  return archive;
}

void save_value(const c10::IValue& value, const std::string& path) {
  naming_the_file_if_out_of_memory(path, tensor_bytes(value), [&] {
    detail::write_file_atomically(path, [&](const detail::ByteSink& sink) { write_value(value, sink); });
  });
}

namespace {

c10::IValue load_archive(caffe2::serialize::PyTorchStreamReader& archive, const std::string& name) {
  if (archive.hasRecord("byteorder")) {
    auto [data, size] = archive.getRecord("byteorder");
    std::string order(static_cast<const char*>(data.get()), size);
    DDP_CHECK(order == "little", "ddp: cannot load '", name, "': it was written on a ", order,
                "-endian machine");
  }
  DDP_CHECK(archive.hasRecord("data.pkl"), "ddp: cannot load '", name,
              "': it has no data.pkl record; it is not a torch.save file (TorchScript archives ",
              "from torch::save(module) are not state dicts)");
  auto [data, size] = archive.getRecord("data.pkl");
  return detail::unpickle_weights_only(name, archive, static_cast<const char*>(data.get()), size);
}

// torch.save's legacy format (before PyTorch 1.6, or
// _use_new_zipfile_serialization=False) is a bare pickle: protocol 2, then
// the pickled magic number 0x1950a86a20f9469cfc6c. It is not corrupt, only
// old; say so, and how to convert it.
void reject_legacy_format(const std::string& head, const std::string& name) {
  static const std::string kLegacyMagic("\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19", 14);
  DDP_CHECK(head.compare(0, kLegacyMagic.size(), kLegacyMagic) != 0, "ddp: cannot load '", name,
            "': it was written in torch.save's legacy (non-zip) format, which ddp does not read. Convert it in ",
            "Python: obj = torch.load(f, weights_only=True); torch.save(obj, f, ",
            "_use_new_zipfile_serialization=True)");
}

// The bytes of save_value's output, for PyTorchStreamReader. Reads past the
// end come back short, so a hostile directory can never read out of bounds.
class BytesAdapter final : public caffe2::serialize::ReadAdapterInterface {
 public:
  explicit BytesAdapter(const std::vector<char>& bytes) : bytes_(bytes) {}
  size_t size() const override { return bytes_.size(); }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    if (pos >= bytes_.size()) return 0;
    n = std::min<size_t>(n, bytes_.size() - pos);
    std::memcpy(buf, bytes_.data() + pos, n);
    return n;
  }

 private:
  const std::vector<char>& bytes_;
};

uint64_t little_endian(const char* p, int n) {
  uint64_t v = 0;
  for (int k = n - 1; k >= 0; --k) v = (v << 8) | static_cast<uint8_t>(p[k]);
  return v;
}

// torch.save stores every record uncompressed, so the records of a real
// checkpoint add up to less than the file. PyTorchStreamReader inflates a
// record whole into memory, at the size the zip directory declares (its
// constructor reads the version record before anything else), so a 1 MiB
// zip of deflated zeros would take a gigabyte. Hence this look at the
// directory before the reader exists. The directory is found as miniz finds
// it; a file that does not parse is left to the reader to refuse.
void check_declared_sizes(const caffe2::serialize::ReadAdapterInterface& source, const std::string& name) {
  const uint64_t file_size = source.size();
  auto read = [&](uint64_t at, size_t n) {
    std::string bytes(n, '\0');
    bool complete = at <= file_size && n <= file_size - at && source.read(at, bytes.data(), n) == n;
    DDP_CHECK(complete, "ddp: cannot load '", name, "': it is not a complete torch.save file (its zip ",
              "directory reaches past the end of the file)");
    return bytes;
  };
  // The end-of-directory record: 22 bytes, then a comment of up to 64 KiB.
  const size_t tail_size = static_cast<size_t>(std::min<uint64_t>(file_size, 22 + 0xFFFF));
  if (tail_size < 22) return;
  const std::string tail = read(file_size - tail_size, tail_size);
  size_t end = tail.rfind(std::string("PK\5\6", 4), tail_size - 22);
  if (end == std::string::npos) return;
  uint64_t entries = little_endian(&tail[end + 10], 2);
  uint64_t directory_size = little_endian(&tail[end + 12], 4);
  uint64_t directory_at = little_endian(&tail[end + 16], 4);
  const uint64_t end_at = file_size - tail_size + end;
  if (end_at >= 20 + 56 && read(end_at - 20, 4) == std::string("PK\6\7", 4)) {
    // zip64: the real numbers are in a record the locator points at, which
    // is usually right before it.
    std::string record = read(end_at - 20 - 56, 56);
    if (record.compare(0, 4, std::string("PK\6\6", 4)) != 0) {
      uint64_t at = little_endian(read(end_at - 20 + 8, 8).data(), 8);
      record = read(at, 56);
    }
    if (record.compare(0, 4, std::string("PK\6\6", 4)) != 0) return;
    entries = little_endian(&record[32], 8);
    directory_size = little_endian(&record[40], 8);
    directory_at = little_endian(&record[48], 8);
  }
  if (directory_at > file_size || directory_size > file_size - directory_at) return;
  const std::string directory = read(directory_at, static_cast<size_t>(directory_size));
  uint64_t declared = 0;
  size_t pos = 0;
  for (uint64_t e = 0; e < entries; ++e) {
    if (pos + 46 > directory.size() || directory.compare(pos, 4, std::string("PK\1\2", 4)) != 0) return;
    const char* header = &directory[pos];
    uint64_t size = little_endian(header + 24, 4);
    const size_t name_size = little_endian(header + 28, 2);
    const size_t extra_size = little_endian(header + 30, 2);
    const size_t comment_size = little_endian(header + 32, 2);
    if (pos + 46 + name_size + extra_size + comment_size > directory.size()) return;
    const std::string record(header + 46, name_size);
    if (size == 0xFFFFFFFF) {
      // zip64's extra field (id 1) holds the real uncompressed size first.
      const char* field = header + 46 + name_size;
      const char* fields_end = field + extra_size;
      while (field + 4 <= fields_end) {
        const uint64_t id = little_endian(field, 2), length = little_endian(field + 2, 2);
        if (id == 1 && length >= 8 && field + 4 + 8 <= fields_end) {
          size = little_endian(field + 4, 8);
          break;
        }
        field += 4 + length;
      }
    }
    DDP_CHECK(size <= file_size - declared, "ddp: cannot load '", name, "': its record '", record,
              "' would inflate its records to more than the file's own ", file_size,
              " bytes (a compressed zip, perhaps a zip bomb); torch.save stores records uncompressed, so it is not ",
              "a torch.save file. Re-save it with torch.save");
    declared += size;
    pos += 46 + name_size + extra_size + comment_size;
  }
}

std::unique_ptr<caffe2::serialize::PyTorchStreamReader> open_archive(
    std::shared_ptr<caffe2::serialize::ReadAdapterInterface> source, const std::string& name) {
  check_declared_sizes(*source, name);
  try {
    return std::make_unique<caffe2::serialize::PyTorchStreamReader>(std::move(source));
  } catch (const c10::Error& e) {
    DDP_CHECK(false, "ddp: cannot load '", name, "': it is not a complete torch.save file (",
                e.what_without_backtrace(), ")");
  } catch (const std::logic_error& e) {
    // The reader's std::stoull of the archive's version record, which
    // throws std::out_of_range for a number of 20 digits.
    DDP_CHECK(false, "ddp: cannot load '", name, "': its version record is not a number in range (",
              detail::message_of(e), "); the file is corrupt or not a torch.save file");
  }
}

// Every failure becomes a ddp error that names the file: a std::exception
// from inside LibTorch (bad_alloc, out_of_range) would otherwise say only
// "stoull" and leave the user to guess which file.
template <typename Load>
c10::IValue naming_the_file(const std::string& name, const Load& load) {
  try {
    return load();
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    DDP_CHECK(false, "ddp: cannot load '", name, "': ", detail::message_of(e));
  }
}

}  // namespace

namespace detail {
std::unique_ptr<caffe2::serialize::PyTorchStreamReader> open_torch_save_file(
    const std::shared_ptr<caffe2::serialize::ReadAdapterInterface>& source, const std::string& name) {
  std::string head(static_cast<size_t>(std::min<uint64_t>(source->size(), 16)), '\0');
  head.resize(source->read(0, head.data(), head.size()));
  reject_legacy_format(head, name);
  auto archive = open_archive(source, name);
  if (archive->hasRecord("byteorder")) {
    auto [data, size] = archive->getRecord("byteorder");
    std::string order(static_cast<const char*>(data.get()), size);
    DDP_CHECK(order == "little", "ddp: cannot load '", name, "': it was written on a ", order, "-endian machine");
  }
  return archive;
}
}  // namespace detail

c10::IValue load_value(const std::string& path) {
  return naming_the_file(path, [&] {
    struct stat info {};
    DDP_CHECK(::stat(path.c_str(), &info) == 0, "ddp: cannot load '", path, "': ", std::strerror(errno));
    {
      char head[16] = {};
      std::ifstream in(path, std::ios::binary);
      in.read(head, sizeof head);
      reject_legacy_format(std::string(head, static_cast<size_t>(in.gcount())), path);
    }
    std::shared_ptr<caffe2::serialize::ReadAdapterInterface> file;
    try {
      file = std::make_shared<caffe2::serialize::FileAdapter>(path);
    } catch (const c10::Error& e) {
      DDP_CHECK(false, "ddp: cannot load '", path, "': ", e.what_without_backtrace());
    }
    auto archive = open_archive(std::move(file), path);
    return load_archive(*archive, path);
  });
}

c10::IValue deserialize_value(const std::vector<char>& bytes, const std::string& name) {
  return naming_the_file(name, [&] {
    reject_legacy_format(std::string(bytes.begin(), bytes.begin() + std::min<size_t>(bytes.size(), 16)), name);
    auto archive = open_archive(std::make_shared<BytesAdapter>(bytes), name);
    return load_archive(*archive, name);
  });
}

void save_state_dict(const StateDict& state, const std::string& path) {
  int64_t bytes = 0;
  for (const auto& item : state) bytes += byte_size(item.second);
  naming_the_file_if_out_of_memory(path, bytes, [&] {
    c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
    for (const auto& [name, tensor] : state) {
      at::Tensor cpu = tensor.detach().to(at::kCPU);
      // A view would save its whole storage, so it is saved as a compact
      // copy; a tensor that is its whole storage is saved as it is, which
      // keeps a save's memory at the model's own.
      const bool whole_storage = cpu.is_contiguous() && cpu.storage_offset() == 0 &&
                                 cpu.storage().nbytes() == cpu.nbytes();
      dict.insert(name, whole_storage ? cpu : cpu.clone(at::MemoryFormat::Contiguous));
    }
    save_value(dict, path);
  });
}

StateDict load_state_dict(const std::string& path) {
  c10::IValue value = load_value(path);
  DDP_CHECK(value.isGenericDict(), "ddp: '", path, "' does not hold a state dict (a dict of tensors)");
  StateDict state;
  for (const auto& item : value.toGenericDict()) {
    DDP_CHECK(item.key().isString() && item.value().isTensor(), "ddp: '", path,
                "' is not a state dict: every key must be a string and every value a tensor");
    state.emplace_back(item.key().toStringRef(), item.value().toTensor());
  }
  return state;
}

namespace {
// Python's Module.state_dict(): a module's own parameters, then its own
// buffers, then each child's, depth first.
void append_state(const torch::nn::Module& module, const std::string& prefix, StateDict& state) {
  for (const auto& item : module.named_parameters(/*recurse=*/false)) state.emplace_back(prefix + item.key(), item.value());
  for (const auto& item : module.named_buffers(/*recurse=*/false)) state.emplace_back(prefix + item.key(), item.value());
  for (const auto& child : module.named_children()) append_state(*child.value(), prefix + child.key() + ".", state);
}

void append_state(const torch::jit::Module& module, const std::string& prefix, StateDict& state) {
  for (const auto& item : module.named_parameters(/*recurse=*/false)) state.emplace_back(prefix + item.name, item.value);
  for (const auto& item : module.named_buffers(/*recurse=*/false)) state.emplace_back(prefix + item.name, item.value);
  for (const auto& child : module.named_children()) append_state(child.value, prefix + child.name + ".", state);
}
}  // namespace

StateDict state_dict(const torch::nn::Module& module) {
  StateDict state;
  append_state(module, "", state);
  return state;
}

StateDict state_dict(const torch::jit::Module& module) {
  StateDict state;
  append_state(module, "", state);
  return state;
}

namespace detail {
void copy_state_into(const StateDict& targets, const StateDict& state) {
  std::map<std::string, at::Tensor> by_name(state.begin(), state.end());
  at::NoGradGuard no_grad;
  for (const auto& [name, target] : targets) {
    auto it = by_name.find(name);
    DDP_CHECK(it != by_name.end(), "ddp: the state dict has no entry '", name,
                "' that the model needs");
    DDP_CHECK(it->second.sizes() == target.sizes(), "ddp: state dict entry '", name, "' has shape ",
                it->second.sizes(), " but the model's has shape ", target.sizes());
    at::Tensor destination = target;
    destination.copy_(it->second);
    by_name.erase(it);
  }
  DDP_CHECK(by_name.empty(), "ddp: the state dict has the entry '", by_name.begin()->first,
              "' that the model lacks");
}
}  // namespace detail

void load_state_dict(torch::nn::Module& module, const StateDict& state) {
  detail::copy_state_into(state_dict(module), state);
}

void load_state_dict(const torch::jit::Module& module, const StateDict& state) {
  detail::copy_state_into(state_dict(module), state);
}

void save(const torch::nn::Module& module, const std::string& path) { save_state_dict(state_dict(module), path); }
void save(const torch::jit::Module& module, const std::string& path) { save_state_dict(state_dict(module), path); }
void save(const torch::nn::AnyModule& module, const std::string& path) { save(*module.ptr(), path); }
namespace detail {
void load_file_into(const StateDict& targets, const std::string& path) {
  StateDict state = load_state_dict(path);  // its errors name the file already
  try {
    copy_state_into(targets, state);
  } catch (const c10::Error& e) {
    std::string why = e.what_without_backtrace();
    if (why.rfind("ddp: ", 0) == 0) why.erase(0, 5);
    DDP_CHECK(false, "ddp: cannot load '", path, "' into this model: ", why,
              " (was the file saved from another architecture?)");
  }
}
}  // namespace detail

void load(torch::nn::Module& module, const std::string& path) { detail::load_file_into(state_dict(module), path); }
void load(const torch::jit::Module& module, const std::string& path) {
  detail::load_file_into(state_dict(module), path);
}
void load(torch::nn::AnyModule& module, const std::string& path) { load(*module.ptr(), path); }

}  // namespace ddp
