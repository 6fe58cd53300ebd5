// FullyShardedDataParallel::load_full_state_dict_file: a full state dict file
// (torch.save's zip format, from ddp::save_state_dict or Python) loaded
// straight into the shards, without the whole model in memory.
//
// torch.save stores each storage as an uncompressed record data/<key>, and
// data.pkl says which storage, offset, shape and strides each name has. So a
// rank reads data.pkl (small), works out where in the file each element of
// its shard lies, and reads just those bytes with pread. The pickle is read
// here by a walker of its own that records where tensors lie instead of
// reading their storages (weights_only_unpickler.cpp reads every storage
// whole, which is what this file exists to avoid); it accepts the same
// opcodes and the same few globals, so it never runs anything either.

#include <ddp/fully_sharded_data_parallel.h>

#include <ddp/error.h>

#include "fsdp_unit.h"
#include "torch_save_file.h"

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

// The values of a weights-only pickle, as far as finding tensors needs them.
struct Value;
using ValueRef = std::shared_ptr<Value>;
struct Value {
  enum class Kind { kNone, kBool, kInt, kFloat, kString, kTuple, kList, kDict, kMark, kGlobal, kStorageType,
                    kStorage, kTensor };
  Kind kind = Kind::kNone;
  int64_t i = 0;
  std::string s;                               // string, global name, storage key
  std::vector<ValueRef> items;                 // tuple, list
  std::vector<std::pair<ValueRef, ValueRef>> kv;  // dict
  at::ScalarType dtype = at::kFloat;           // storage type, storage
  TensorLocation tensor;                       // tensor
  int depth = 0;
};

ValueRef make(Value::Kind kind) {
  auto value = std::make_shared<Value>();
  value->kind = kind;
  return value;
}

const std::map<std::string, at::ScalarType>& storage_types() {
  static const std::map<std::string, at::ScalarType> types = {
      {"torch.FloatStorage", at::kFloat},     {"torch.DoubleStorage", at::kDouble},
      {"torch.HalfStorage", at::kHalf},       {"torch.BFloat16Storage", at::kBFloat16},
      {"torch.LongStorage", at::kLong},       {"torch.IntStorage", at::kInt},
      {"torch.ShortStorage", at::kShort},     {"torch.CharStorage", at::kChar},
      {"torch.ByteStorage", at::kByte},       {"torch.BoolStorage", at::kBool},
      {"torch.ComplexFloatStorage", at::kComplexFloat},
      {"torch.ComplexDoubleStorage", at::kComplexDouble},
  };
  return types;
}

// Walks data.pkl and returns, per name, where its tensor lies.
class StateDictIndexer {
 public:
  StateDictIndexer(const std::string& name, const char* data, size_t size) : name_(name), data_(data), size_(size) {}

  std::vector<std::pair<std::string, TensorLocation>> run() {
    ValueRef result = walk();
    DDP_CHECK(result->kind == Value::Kind::kDict, fail("it does not hold a state dict (a dict of tensors)"));
    std::vector<std::pair<std::string, TensorLocation>> index;
    for (const auto& [key, value] : result->kv) {
      DDP_CHECK(key->kind == Value::Kind::kString && value->kind == Value::Kind::kTensor,
                fail("it is not a state dict: every key must be a string and every value a tensor"));
      index.emplace_back(key->s, value->tensor);
    }
    return index;
  }

 private:
  ValueRef walk() {
    while (true) {
      const uint8_t op = read_u8();
      switch (op) {
        case 0x80: read_u8(); break;                    // PROTO
        case 0x95: read_bytes(8); break;                // FRAME
        case '.':                                       // STOP
          DDP_CHECK(stack_.size() == 1, fail("the pickle ends with ", stack_.size(), " values"));
          return stack_.back();
        case 'c': {                                     // GLOBAL
          std::string module = read_line();
          push(global(module + "." + read_line()));
          break;
        }
        case 0x93: {                                    // STACK_GLOBAL
          ValueRef name = pop();
          ValueRef module = pop();
          push(global(module->s + "." + name->s));
          break;
        }
        case 'q': memo_[read_u8()] = top(); break;      // BINPUT
        case 'r': memo_[read_u32()] = top(); break;     // LONG_BINPUT
        case 0x94: memo_[memo_.size()] = top(); break;  // MEMOIZE
        case 'h': push(memo(read_u8())); break;         // BINGET
        case 'j': push(memo(read_u32())); break;        // LONG_BINGET
        case '(': push(make(Value::Kind::kMark)); break;
        case ')': push(make(Value::Kind::kTuple)); break;
        case 't': push(tuple(pop_to_mark())); break;
        case 0x85: { auto a = pop(); push(tuple({a})); break; }
        case 0x86: { auto b = pop(); auto a = pop(); push(tuple({a, b})); break; }
        case 0x87: { auto c = pop(); auto b = pop(); auto a = pop(); push(tuple({a, b, c})); break; }
        case ']': push(make(Value::Kind::kList)); break;
        case 'a': {                                     // APPEND
          auto value = pop();
          append(expect(top(), Value::Kind::kList, "APPEND"), {value});
          break;
        }
        case 'e': {                                     // APPENDS
          auto values = pop_to_mark();
          append(expect(top(), Value::Kind::kList, "APPENDS"), values);
          break;
        }
        case '}': push(make(Value::Kind::kDict)); break;
        case 's': {                                     // SETITEM
          auto value = pop();
          auto key = pop();
          set_items(expect(top(), Value::Kind::kDict, "SETITEM"), {key, value});
          break;
        }
        case 'u': {                                     // SETITEMS
          auto values = pop_to_mark();
          DDP_CHECK(values.size() % 2 == 0, fail("SETITEMS with an odd number of values"));
          set_items(expect(top(), Value::Kind::kDict, "SETITEMS"), values);
          break;
        }
        case 'N': push(make(Value::Kind::kNone)); break;
        case 0x88: push(integer(Value::Kind::kBool, 1)); break;
        case 0x89: push(integer(Value::Kind::kBool, 0)); break;
        case 'K': push(integer(Value::Kind::kInt, read_u8())); break;
        case 'M': push(integer(Value::Kind::kInt, read_u16())); break;
        case 'J': push(integer(Value::Kind::kInt, static_cast<int32_t>(read_u32()))); break;
        case 0x8a: push(integer(Value::Kind::kInt, read_long(read_u8()))); break;  // LONG1
        case 'G': read_bytes(8); push(make(Value::Kind::kFloat)); break;           // BINFLOAT
        case 'X': push(string(read_bytes(read_u32()))); break;                     // BINUNICODE
        case 0x8c: push(string(read_bytes(read_u8()))); break;                     // SHORT_BINUNICODE
        case 'B': push(string(read_bytes(read_u32()))); break;                     // BINBYTES
        case 'C': push(string(read_bytes(read_u8()))); break;                      // SHORT_BINBYTES
        case 'Q': push(storage(pop())); break;                                      // BINPERSID
        case 'R': {                                                                 // REDUCE
          ValueRef args = pop();
          ValueRef callable = pop();
          push(call(callable, args));
          break;
        }
        case 'b': pop(); break;  // BUILD: OrderedDict's _metadata, a tensor's extras; not needed
        default:
          DDP_CHECK(false, fail("unsupported pickle opcode 0x", std::hex, static_cast<int>(op),
                                "; only weights-only checkpoints can be loaded"));
      }
    }
  }

  template <typename... Args>
  std::string fail(const Args&... args) const {
    return c10::str("ddp: cannot load '", name_, "': ", args...);
  }

  ValueRef global(const std::string& name) {
    auto storage = storage_types().find(name);
    if (storage != storage_types().end()) {
      auto value = make(Value::Kind::kStorageType);
      value->dtype = storage->second;
      return value;
    }
    for (const char* allowed : {"collections.OrderedDict", "torch._utils._rebuild_tensor_v2",
                                "torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state"}) {
      if (name == allowed) {
        auto value = make(Value::Kind::kGlobal);
        value->s = name;
        return value;
      }
    }
    DDP_CHECK(false, fail("it refers to the Python global '", name,
                          "', which a weights-only checkpoint (a dict of tensors) never contains"));
  }

  // ('storage', StorageType, key, location, numel): the record, not its data.
  ValueRef storage(const ValueRef& id) {
    DDP_CHECK(id->kind == Value::Kind::kTuple && id->items.size() >= 5 && id->items[0]->s == "storage" &&
                  id->items[1]->kind == Value::Kind::kStorageType && id->items[2]->kind == Value::Kind::kString &&
                  id->items[4]->kind == Value::Kind::kInt && id->items[4]->i >= 0,
              fail("unsupported persistent id"));
    auto value = make(Value::Kind::kStorage);
    value->s = id->items[2]->s;
    value->dtype = id->items[1]->dtype;
    value->i = id->items[4]->i;
    return value;
  }

  ValueRef call(const ValueRef& callable, const ValueRef& args) {
    DDP_CHECK(callable->kind == Value::Kind::kGlobal && args->kind == Value::Kind::kTuple,
              fail("malformed pickle (REDUCE on a non-callable)"));
    const auto& a = args->items;
    if (callable->s == "collections.OrderedDict") return make(Value::Kind::kDict);
    if (callable->s == "torch._utils._rebuild_tensor_v2") {
      DDP_CHECK(a.size() >= 4 && a[0]->kind == Value::Kind::kStorage && a[1]->kind == Value::Kind::kInt,
                fail("malformed _rebuild_tensor_v2 call"));
      auto value = make(Value::Kind::kTensor);
      TensorLocation& location = value->tensor;
      location.key = a[0]->s;
      location.dtype = a[0]->dtype;
      location.storage_numel = a[0]->i;
      location.offset = a[1]->i;
      location.sizes = int_list(a[2]);
      location.strides = int_list(a[3]);
      DDP_CHECK(location.sizes.size() == location.strides.size(), fail("malformed _rebuild_tensor_v2 call"));
      // The last element the view touches must lie inside the storage; the
      // numbers come from the file, so every step is checked for overflow.
      int64_t last = location.offset;
      bool ok = location.offset >= 0, empty = false;
      for (size_t d = 0; d < location.sizes.size() && ok; ++d) {
        ok = location.sizes[d] >= 0 && location.strides[d] >= 0;
        if (location.sizes[d] == 0) empty = true;
        int64_t reach = 0;
        if (ok && location.sizes[d] > 0) {
          ok = !c10::mul_overflows(location.sizes[d] - 1, location.strides[d], &reach) &&
               !c10::add_overflows(last, reach, &last);
        }
      }
      DDP_CHECK(ok && (empty || last < location.storage_numel), fail("a tensor reaches past the end of its storage"));
      return value;
    }
    // _rebuild_parameter(data, requires_grad, backward_hooks[, state]).
    DDP_CHECK(!a.empty() && a[0]->kind == Value::Kind::kTensor, fail("malformed parameter"));
    return a[0];
  }

  std::vector<int64_t> int_list(const ValueRef& value) {
    DDP_CHECK(value->kind == Value::Kind::kTuple || value->kind == Value::Kind::kList, fail("malformed tensor shape"));
    std::vector<int64_t> out;
    for (const auto& item : value->items) {
      DDP_CHECK(item->kind == Value::Kind::kInt, fail("malformed tensor shape"));
      out.push_back(item->i);
    }
    return out;
  }

  static ValueRef integer(Value::Kind kind, int64_t i) {
    auto value = make(kind);
    value->i = i;
    return value;
  }
  static ValueRef string(std::string s) {
    auto value = make(Value::Kind::kString);
    value->s = std::move(s);
    return value;
  }
  ValueRef tuple(std::vector<ValueRef> items) {
    auto value = make(Value::Kind::kTuple);
    for (const auto& item : items) deepen(value, item);
    value->items = std::move(items);
    return value;
  }
  void append(const ValueRef& list, const std::vector<ValueRef>& values) {
    for (const auto& value : values) deepen(list, value);
    list->items.insert(list->items.end(), values.begin(), values.end());
  }
  void set_items(const ValueRef& dict, const std::vector<ValueRef>& values) {
    for (size_t k = 0; k < values.size(); k += 2) {
      deepen(dict, values[k]);
      deepen(dict, values[k + 1]);
      dict->kv.emplace_back(values[k], values[k + 1]);
    }
  }
  // Bounded nesting: a hostile file cannot build a structure deep enough to
  // overflow the stack when it is freed.
  void deepen(const ValueRef& container, const ValueRef& child) {
    container->depth = std::max(container->depth, child->depth + 1);
    DDP_CHECK(container->depth <= 200, fail("values are nested more than 200 deep"));
  }
  ValueRef expect(ValueRef value, Value::Kind kind, const char* op) {
    DDP_CHECK(value->kind == kind, fail("malformed pickle (", op, " on the wrong type)"));
    return value;
  }

  void need(size_t n) const { DDP_CHECK(n <= size_ - pos_, fail("the pickle is truncated")); }
  uint8_t read_u8() {
    need(1);
    return static_cast<uint8_t>(data_[pos_++]);
  }
  uint16_t read_u16() { return static_cast<uint16_t>(read_long_unsigned(2)); }
  uint32_t read_u32() { return static_cast<uint32_t>(read_long_unsigned(4)); }
  uint64_t read_long_unsigned(size_t n) {
    need(n);
    uint64_t v = 0;
    for (size_t k = n; k-- > 0;) v = (v << 8) | static_cast<uint8_t>(data_[pos_ + k]);
    pos_ += n;
    return v;
  }
  int64_t read_long(size_t n) {
    DDP_CHECK(n <= 8, fail("integer of ", n, " bytes is too large"));
    need(n);
    const bool negative = n > 0 && (static_cast<uint8_t>(data_[pos_ + n - 1]) & 0x80);
    uint64_t v = read_long_unsigned(n);
    if (negative && n < 8) v |= ~uint64_t{0} << (8 * n);
    return static_cast<int64_t>(v);
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

  void push(ValueRef value) { stack_.push_back(std::move(value)); }
  ValueRef pop() {
    DDP_CHECK(!stack_.empty(), fail("malformed pickle (stack underflow)"));
    ValueRef value = std::move(stack_.back());
    stack_.pop_back();
    return value;
  }
  ValueRef top() {
    DDP_CHECK(!stack_.empty(), fail("malformed pickle (empty stack)"));
    return stack_.back();
  }
  ValueRef memo(size_t key) {
    auto it = memo_.find(key);
    DDP_CHECK(it != memo_.end(), fail("malformed pickle (memo ", key, " unset)"));
    return it->second;
  }
  std::vector<ValueRef> pop_to_mark() {
    std::vector<ValueRef> values;
    while (true) {
      ValueRef value = pop();
      if (value->kind == Value::Kind::kMark) break;
      values.push_back(std::move(value));
    }
    return {values.rbegin(), values.rend()};
  }

  const std::string& name_;
  const char* data_;
  size_t size_;
  size_t pos_ = 0;
  std::vector<ValueRef> stack_;
  std::unordered_map<size_t, ValueRef> memo_;
};

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
    index = StateDictIndexer(path, static_cast<const char*>(pickle.get()), pickle_size).run();
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    DDP_CHECK(false, "ddp: cannot load '", path, "': ", e.what());
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
      find(unit->param_names[j], unit->params[j].sizes());
      needed[unit->param_names[j]] = true;
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
    auto [start, length] = shard_range(*unit);
    at::Tensor shard = at::zeros({length}, unit->shard.options().requires_grad(false));
    for (size_t j = 0; j < unit->params.size(); ++j) {
      const int64_t begin = std::max(start, unit->offsets[j]);
      const int64_t end = std::min(start + length, unit->offsets[j] + unit->params[j].numel());
      if (begin >= end) continue;
      at::Tensor piece = reader.read(*by_name.at(unit->param_names[j]), begin - unit->offsets[j], end - begin);
      shard.narrow(0, begin - start, end - begin).copy_(piece);
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
    Unit& unit = *units_[u];
    unit.shard.detach().copy_(shards[u]);
    // Inside summon_full_params(): the gathered parameters follow the shards.
    if (unit.gathered && !shard_is_full()) {
      unit.gathered = false;
      start_gather(unit);
      finish_gather(unit);
    }
  }
  for (size_t i = 0; i < replicated_tensors.size(); ++i) replicated_tensors[i].second.detach().copy_(whole[i]);
  refresh_frozen_parameters();
}

}  // namespace ddp::detail
