#include <ddp/checkpoint.h>

#include <ddp/error.h>

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <c10/util/safe_numerics.h>
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
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <unordered_map>

namespace ddp {
namespace {

// ---------------------------------------------------------------------------
// Atomic files

void write_all(int fd, const char* data, size_t size, const std::string& path) {
  while (size > 0) {
    ssize_t n = ::write(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    DDP_CHECK(n > 0, "ddp: writing '", path, "' failed: ", std::strerror(errno));
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

// ---------------------------------------------------------------------------
// A weights-only unpickler for torch.save's zip format.

// What the unpickler's stack holds: a small mirror of the Python objects a
// weights-only pickle can build.
struct PyObject;
using PyRef = std::shared_ptr<PyObject>;

struct PyObject {
  enum class Kind { kNone, kBool, kInt, kFloat, kString, kTuple, kList, kDict, kTensor, kStorageType,
                    kGlobal, kStorage, kMark };
  Kind kind = Kind::kNone;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;                            // string; global "module.name"
  std::vector<PyRef> items;                 // tuple, list
  std::vector<std::pair<PyRef, PyRef>> kv;  // dict, in insertion order
  at::Tensor tensor;                        // tensor; storage (1-D, its whole data)
  c10::ScalarType dtype = c10::kFloat;      // storage type
  int depth = 0;                            // nesting below this object

  static PyRef make(Kind kind) {
    auto o = std::make_shared<PyObject>();
    o->kind = kind;
    return o;
  }
};

const std::map<std::string, c10::ScalarType>& storage_types() {
  static const std::map<std::string, c10::ScalarType> types = {
      {"torch.FloatStorage", c10::kFloat},     {"torch.DoubleStorage", c10::kDouble},
      {"torch.HalfStorage", c10::kHalf},       {"torch.BFloat16Storage", c10::kBFloat16},
      {"torch.LongStorage", c10::kLong},       {"torch.IntStorage", c10::kInt},
      {"torch.ShortStorage", c10::kShort},     {"torch.CharStorage", c10::kChar},
      {"torch.ByteStorage", c10::kByte},       {"torch.BoolStorage", c10::kBool},
      {"torch.ComplexFloatStorage", c10::kComplexFloat},
      {"torch.ComplexDoubleStorage", c10::kComplexDouble},
  };
  return types;
}

class WeightsOnlyUnpickler {
 public:
  WeightsOnlyUnpickler(const std::string& path, caffe2::serialize::PyTorchStreamReader& archive,
                       const char* data, size_t size)
      : path_(path), archive_(archive), data_(data), size_(size) {}

  PyRef run() {
    while (true) {
      uint8_t op = read_u8();
      switch (op) {
        case 0x80: read_u8(); break;                   // PROTO
        case 0x95: read_bytes(8); break;               // FRAME
        case '.': {                                    // STOP
          DDP_CHECK(stack_.size() == 1, fail("the pickle ends with ", stack_.size(), " values"));
          return stack_.back();
        }
        case 'c': {                                    // GLOBAL
          std::string module = read_line();
          std::string name = read_line();
          push(global(module + "." + name));
          break;
        }
        case 0x93: {                                   // STACK_GLOBAL
          PyRef name = pop();
          PyRef module = pop();
          push(global(module->s + "." + name->s));
          break;
        }
        case 'q': memo_[read_u8()] = top(); break;     // BINPUT
        case 'r': memo_[read_u32()] = top(); break;    // LONG_BINPUT
        case 0x94: memo_[memo_.size()] = top(); break; // MEMOIZE
        case 'h': push(memo(read_u8())); break;        // BINGET
        case 'j': push(memo(read_u32())); break;       // LONG_BINGET
        case '(': push(PyObject::make(PyObject::Kind::kMark)); break;
        case ')': push(PyObject::make(PyObject::Kind::kTuple)); break;
        case 't': push(tuple(pop_to_mark())); break;
        case 0x85: { auto a = pop(); push(tuple({a})); break; }
        case 0x86: { auto b = pop(); auto a = pop(); push(tuple({a, b})); break; }
        case 0x87: { auto c = pop(); auto b = pop(); auto a = pop(); push(tuple({a, b, c})); break; }
        case ']': push(PyObject::make(PyObject::Kind::kList)); break;
        case 'a': {
          auto v = pop();
          auto list = expect(top(), PyObject::Kind::kList, "APPEND");
          deepen(list, v);
          list->items.push_back(v);
          break;
        }
        case 'e': {
          auto values = pop_to_mark();
          auto list = expect(top(), PyObject::Kind::kList, "APPENDS");
          for (const auto& v : values) deepen(list, v);
          list->items.insert(list->items.end(), values.begin(), values.end());
          break;
        }
        case '}': push(PyObject::make(PyObject::Kind::kDict)); break;
        case 's': {
          auto v = pop();
          auto k = pop();
          auto dict = expect(top(), PyObject::Kind::kDict, "SETITEM");
          deepen(dict, k);
          deepen(dict, v);
          dict->kv.emplace_back(k, v);
          break;
        }
        case 'u': {
          auto values = pop_to_mark();
          auto dict = expect(top(), PyObject::Kind::kDict, "SETITEMS");
          DDP_CHECK(values.size() % 2 == 0, fail("SETITEMS with an odd number of values"));
          for (size_t k = 0; k < values.size(); k += 2) {
            deepen(dict, values[k]);
            deepen(dict, values[k + 1]);
            dict->kv.emplace_back(values[k], values[k + 1]);
          }
          break;
        }
        case 'N': push(PyObject::make(PyObject::Kind::kNone)); break;
        case 0x88: push(boolean(true)); break;
        case 0x89: push(boolean(false)); break;
        case 'K': push(integer(read_u8())); break;
        case 'M': push(integer(read_u16())); break;
        case 'J': push(integer(static_cast<int32_t>(read_u32()))); break;
        case 0x8a: push(integer(read_long(read_u8()))); break;  // LONG1
        case 'G': push(real(read_double_be())); break;
        case 'X': push(string(read_bytes(read_u32()))); break;  // BINUNICODE
        case 0x8c: push(string(read_bytes(read_u8()))); break;  // SHORT_BINUNICODE
        case 'B': push(string(read_bytes(read_u32()))); break;  // BINBYTES
        case 'C': push(string(read_bytes(read_u8()))); break;   // SHORT_BINBYTES
        case 'Q': push(persistent_load(pop())); break;          // BINPERSID
        case 'R': {                                             // REDUCE
          PyRef args = pop();
          PyRef callable = pop();
          push(call(callable, args));
          break;
        }
        case 'b': {                                             // BUILD
          pop();  // The state: OrderedDict's _metadata, tensor extras. Not needed.
          break;
        }
        default:
          DDP_CHECK(false, fail("unsupported pickle opcode 0x", std::hex, static_cast<int>(op),
                                  "; only weights-only checkpoints can be loaded"));
      }
    }
  }

 private:
  template <typename... Args>
  std::string fail(const Args&... args) const {
    return c10::str("ddp: cannot load '", path_, "': ", args...);
  }

  void need(size_t n) const {
    DDP_CHECK(pos_ + n <= size_, fail("the pickle is truncated"));
  }
  uint8_t read_u8() { need(1); return static_cast<uint8_t>(data_[pos_++]); }
  uint16_t read_u16() { auto s = read_bytes(2); return static_cast<uint16_t>(static_cast<uint8_t>(s[0]) | (static_cast<uint8_t>(s[1]) << 8)); }
  uint32_t read_u32() {
    auto s = read_bytes(4);
    uint32_t v = 0;
    for (int k = 3; k >= 0; --k) v = (v << 8) | static_cast<uint8_t>(s[k]);
    return v;
  }
  int64_t read_long(size_t n) {
    DDP_CHECK(n <= 8, fail("integer of ", n, " bytes is too large"));
    auto s = read_bytes(n);
    uint64_t v = 0;
    for (size_t k = n; k-- > 0;) v = (v << 8) | static_cast<uint8_t>(s[k]);
    if (n > 0 && n < 8 && (static_cast<uint8_t>(s[n - 1]) & 0x80)) v |= ~uint64_t{0} << (8 * n);
    return static_cast<int64_t>(v);
  }
  double read_double_be() {
    auto s = read_bytes(8);
    uint64_t bits = 0;
    for (int k = 0; k < 8; ++k) bits = (bits << 8) | static_cast<uint8_t>(s[k]);
    double v;
    std::memcpy(&v, &bits, sizeof(v));
    return v;
  }
  std::string read_bytes(size_t n) {
    need(n);
    std::string s(data_ + pos_, n);
    pos_ += n;
    return s;
  }
  std::string read_line() {
    size_t end = pos_;
    while (end < size_ && data_[end] != '\n') ++end;
    DDP_CHECK(end < size_, fail("the pickle is truncated"));
    std::string s(data_ + pos_, end - pos_);
    pos_ = end + 1;
    return s;
  }

  void push(PyRef v) { stack_.push_back(std::move(v)); }
  PyRef pop() {
    DDP_CHECK(!stack_.empty(), fail("malformed pickle (stack underflow)"));
    PyRef v = stack_.back();
    stack_.pop_back();
    return v;
  }
  PyRef top() {
    DDP_CHECK(!stack_.empty(), fail("malformed pickle (empty stack)"));
    return stack_.back();
  }
  PyRef memo(size_t key) {
    auto it = memo_.find(key);
    DDP_CHECK(it != memo_.end(), fail("malformed pickle (memo ", key, " unset)"));
    return it->second;
  }
  std::vector<PyRef> pop_to_mark() {
    std::vector<PyRef> values;
    while (true) {
      PyRef v = pop();
      if (v->kind == PyObject::Kind::kMark) break;
      values.push_back(v);
    }
    return {values.rbegin(), values.rend()};
  }
  PyRef expect(PyRef v, PyObject::Kind kind, const char* op) {
    DDP_CHECK(v->kind == kind, fail("malformed pickle (", op, " on the wrong type)"));
    return v;
  }

  PyRef tuple(std::vector<PyRef> items) {
    auto t = PyObject::make(PyObject::Kind::kTuple);
    for (const auto& item : items) deepen(t, item);
    t->items = std::move(items);
    return t;
  }

  // Containers record how deep they nest, so a hostile file cannot build a
  // structure deep enough to overflow the stack when it is converted or freed.
  void deepen(const PyRef& container, const PyRef& child) {
    container->depth = std::max(container->depth, child->depth + 1);
    DDP_CHECK(container->depth <= kMaxDepth, fail("values are nested more than ", kMaxDepth, " deep"));
  }
  static constexpr int kMaxDepth = 200;
  static PyRef boolean(bool b) { auto o = PyObject::make(PyObject::Kind::kBool); o->b = b; return o; }
  static PyRef integer(int64_t i) { auto o = PyObject::make(PyObject::Kind::kInt); o->i = i; return o; }
  static PyRef real(double f) { auto o = PyObject::make(PyObject::Kind::kFloat); o->f = f; return o; }
  static PyRef string(std::string s) { auto o = PyObject::make(PyObject::Kind::kString); o->s = std::move(s); return o; }

  // The allowlist: anything else in a checkpoint means it is not weights-only.
  PyRef global(const std::string& name) {
    auto storage = storage_types().find(name);
    if (storage != storage_types().end()) {
      auto o = PyObject::make(PyObject::Kind::kStorageType);
      o->dtype = storage->second;
      o->s = name;
      return o;
    }
    static const char* callables[] = {"collections.OrderedDict", "torch._utils._rebuild_tensor_v2",
                                      "torch._utils._rebuild_parameter",
                                      "torch._utils._rebuild_parameter_with_state"};
    for (const char* allowed : callables) {
      if (name == allowed) {
        auto o = PyObject::make(PyObject::Kind::kGlobal);
        o->s = name;
        return o;
      }
    }
    DDP_CHECK(false, fail("it refers to the Python global '", name,
                            "', which a weights-only checkpoint (a dict of tensors) never contains"));
  }

  PyRef call(const PyRef& callable, const PyRef& args) {
    DDP_CHECK(callable->kind == PyObject::Kind::kGlobal && args->kind == PyObject::Kind::kTuple,
                fail("malformed pickle (REDUCE on a non-callable)"));
    const auto& a = args->items;
    if (callable->s == "collections.OrderedDict") return PyObject::make(PyObject::Kind::kDict);
    if (callable->s == "torch._utils._rebuild_tensor_v2") {
      DDP_CHECK(a.size() >= 4 && a[0]->kind == PyObject::Kind::kStorage,
                  fail("malformed _rebuild_tensor_v2 call"));
      auto sizes = int_list(a[2]);
      auto strides = int_list(a[3]);
      DDP_CHECK(a[1]->kind == PyObject::Kind::kInt && sizes.size() == strides.size(),
                  fail("malformed _rebuild_tensor_v2 call"));
      int64_t offset = a[1]->i;
      const at::Tensor& storage = a[0]->tensor;
      // The last element the view touches must lie inside the storage; every
      // step is checked for overflow, since the numbers come from the file.
      int64_t last = offset;
      bool empty = false;
      bool ok = offset >= 0;
      for (size_t d = 0; d < sizes.size() && ok; ++d) {
        ok = sizes[d] >= 0 && strides[d] >= 0;
        if (sizes[d] == 0) empty = true;
        int64_t reach = 0;
        if (ok && sizes[d] > 0) {
          ok = !c10::mul_overflows(sizes[d] - 1, strides[d], &reach) && !c10::add_overflows(last, reach, &last);
        }
      }
      DDP_CHECK(ok && (empty || last < storage.numel()), fail("a tensor reaches past the end of its storage"));
      auto o = PyObject::make(PyObject::Kind::kTensor);
      o->tensor = storage.as_strided(sizes, strides, offset);
      return o;
    }
    // _rebuild_parameter(data, requires_grad, backward_hooks[, state]).
    DDP_CHECK(!a.empty() && a[0]->kind == PyObject::Kind::kTensor, fail("malformed parameter"));
    return a[0];
  }

  std::vector<int64_t> int_list(const PyRef& v) {
    DDP_CHECK(v->kind == PyObject::Kind::kTuple || v->kind == PyObject::Kind::kList,
                fail("malformed tensor shape"));
    std::vector<int64_t> out;
    for (const auto& item : v->items) {
      DDP_CHECK(item->kind == PyObject::Kind::kInt, fail("malformed tensor shape"));
      out.push_back(item->i);
    }
    return out;
  }

  // ('storage', StorageType, key, location, numel) -> the storage's data,
  // read from the archive's data/<key> record.
  PyRef persistent_load(const PyRef& id) {
    DDP_CHECK(id->kind == PyObject::Kind::kTuple && id->items.size() >= 5 &&
                    id->items[0]->s == "storage" && id->items[1]->kind == PyObject::Kind::kStorageType,
                fail("unsupported persistent id"));
    const std::string& key = id->items[2]->s;
    auto cached = storages_.find(key);
    if (cached != storages_.end()) return cached->second;
    c10::ScalarType dtype = id->items[1]->dtype;
    DDP_CHECK(id->items[4]->kind == PyObject::Kind::kInt && id->items[4]->i >= 0, fail("malformed storage size"));
    int64_t numel = id->items[4]->i;
    std::string record = "data/" + key;
    DDP_CHECK(archive_.hasRecord(record), fail("the archive lacks the record '", record,
                                                 "' (the file is incomplete)"));
    auto [data, size] = archive_.getRecord(record);
    DDP_CHECK(static_cast<uint64_t>(numel) <= size / c10::elementSize(dtype),
                fail("record '", record, "' holds ", size, " bytes, too few for ", numel, " elements"));
    size_t expected = static_cast<size_t>(numel) * c10::elementSize(dtype);
    DDP_CHECK(size >= expected, fail("record '", record, "' holds ", size, " bytes, but ", expected,
                                       " are needed"));
    auto o = PyObject::make(PyObject::Kind::kStorage);
    o->tensor = at::empty({numel}, at::TensorOptions().dtype(dtype));
    if (expected > 0) std::memcpy(o->tensor.data_ptr(), data.get(), expected);
    storages_[key] = o;
    return o;
  }

  const std::string& path_;
  caffe2::serialize::PyTorchStreamReader& archive_;
  const char* data_;
  size_t size_;
  size_t pos_ = 0;
  std::vector<PyRef> stack_;
  std::unordered_map<size_t, PyRef> memo_;
  std::unordered_map<std::string, PyRef> storages_;
};

// Turns the unpickler's objects into IValues, copying what the memo shares
// once per reference. That is where a few kilobytes of hostile pickle become
// gigabytes: a tuple that holds one value twice, memoized, then held twice
// by the next, and so on, doubles with every five bytes, and one long string
// referenced many times multiplies its length. An honest pickle builds about
// as much as it holds (every value takes an opcode, every string's bytes are
// in the pickle), so what is built gets a budget in proportion to the
// pickle's size that no torch.save file comes near. Tensors are shared, not
// copied: their storages are bounded by the records they were read from.
class Materializer {
 public:
  Materializer(const std::string& path, size_t pickle_size)
      : path_(path), pickle_size_(pickle_size), budget_(kSlack + kPerPickleByte * pickle_size) {}

  c10::IValue convert(const PyRef& v, int depth = 0) {
    using Kind = PyObject::Kind;
    // A container that (through the memo) holds itself never bottoms out.
    DDP_CHECK(depth <= 2 * 200, "ddp: cannot load '", path_, "': its values refer to themselves");
    charge(kValueCost + (v->kind == Kind::kString ? v->s.size() : 0));
    switch (v->kind) {
      case Kind::kNone: return c10::IValue();
      case Kind::kBool: return c10::IValue(v->b);
      case Kind::kInt: return c10::IValue(v->i);
      case Kind::kFloat: return c10::IValue(v->f);
      case Kind::kString: return c10::IValue(v->s);
      case Kind::kTensor: return c10::IValue(v->tensor);
      case Kind::kTuple: {
        std::vector<c10::IValue> items;
        for (const auto& item : v->items) items.push_back(convert(item, depth + 1));
        return c10::ivalue::Tuple::create(std::move(items));
      }
      case Kind::kList: {
        c10::impl::GenericList list(c10::AnyType::get());
        for (const auto& item : v->items) list.push_back(convert(item, depth + 1));
        return list;
      }
      case Kind::kDict: {
        c10::impl::GenericDict dict(c10::AnyType::get(), c10::AnyType::get());
        for (const auto& [key, value] : v->kv) dict.insert(convert(key, depth + 1), convert(value, depth + 1));
        return dict;
      }
      default:
        DDP_CHECK(false, "ddp: cannot load '", path_, "': it holds a bare storage or global");
    }
  }

 private:
  // About what one IValue and its share of a container take.
  static constexpr size_t kValueCost = 32;
  static constexpr size_t kPerPickleByte = 32;
  static constexpr size_t kSlack = size_t{8} << 20;

  void charge(size_t bytes) {
    DDP_CHECK(bytes <= budget_ - spent_, "ddp: cannot load '", path_, "': its ", pickle_size_,
              "-byte pickle expands to more than ", budget_ >> 20,
              " MiB of values by repeating shared references (a pickle bomb); a torch.save file never does");
    spent_ += bytes;
  }

  const std::string& path_;
  const size_t pickle_size_;
  const size_t budget_;
  size_t spent_ = 0;
};

}  // namespace

namespace {

// Removes the temporaries that killed writers left in `dir`: files named
// like ours, "<name>.tmp.<pid>", whose process is gone. A temporary is kept
// while its pid is alive on this host (kill(pid, 0)), and while any writer
// holds its lock (writers lock their temporary until the rename), which
// also protects a writer on another host that shares the directory.
void remove_stale_temporaries(const std::string& dir) {
  DIR* directory = ::opendir(dir.c_str());
  if (directory == nullptr) return;
  const pid_t self = ::getpid();
  while (dirent* entry = ::readdir(directory)) {
    std::string name = entry->d_name;
    size_t marker = name.rfind(".tmp.");
    if (marker == std::string::npos || marker == 0) continue;
    std::string digits = name.substr(marker + 5);
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

}  // namespace

void write_file_atomically(const std::string& path, const std::vector<char>& bytes) {
  std::string temporary = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  DDP_CHECK(fd >= 0, "ddp: cannot create '", temporary, "': ", std::strerror(errno),
              " (does the directory exist and is it writable?)");
  // Held until the temporary is renamed or removed: it tells
  // remove_stale_temporaries that a writer is still at work on it.
  ::flock(fd, LOCK_EX | LOCK_NB);
  try {
    write_all(fd, bytes.data(), bytes.size(), temporary);
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

std::vector<char> serialize_value(const c10::IValue& value) {
  std::vector<char> pickle;
  // Untagged aggregates: tagged ones name torch.jit globals that Python's
  // weights_only loader rejects.
  torch::jit::Pickler pickler(
      [&](const char* bytes, size_t n) { pickle.insert(pickle.end(), bytes, bytes + n); },
      /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
      /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();

  std::vector<char> archive;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* bytes, size_t n) -> size_t {
    const char* begin = static_cast<const char*>(bytes);
    archive.insert(archive.end(), begin, begin + n);
    return n;
  });
  torch::jit::writeArchiveAndTensors("data", pickle.data(), pickle.size(), pickler.tensorData(), writer);
  writer.writeEndOfFile();
  return archive;
}

void save_value(const c10::IValue& value, const std::string& path) {
  write_file_atomically(path, serialize_value(value));
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
  WeightsOnlyUnpickler unpickler(name, archive, static_cast<const char*>(data.get()), size);
  return Materializer(name, size).convert(unpickler.run());
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
              e.what(), "); the file is corrupt or not a torch.save file");
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
    DDP_CHECK(false, "ddp: cannot load '", name, "': ", e.what());
  }
}

}  // namespace

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
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  for (const auto& [name, tensor] : state) {
    // A compact CPU copy: views would otherwise save their whole storage.
    dict.insert(name, tensor.detach().to(at::kCPU).contiguous().clone());
  }
  save_value(dict, path);
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
