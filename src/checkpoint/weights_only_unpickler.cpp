// A weights-only unpickler for torch.save's zip format, and the bounds on
// what it builds (see weights_only_unpickler.h).

#include "checkpoint/weights_only_unpickler.h"

#include <ddp/error.h>

#include <ATen/Functions.h>
#include <c10/util/safe_numerics.h>
#include <caffe2/serialize/inline_container.h>

#include <cstring>
#include <map>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ddp::detail {
namespace {

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
                       const char* data, size_t size, const StorageSource& storages)
      : path_(path), archive_(archive), data_(data), size_(size), storages_source_(storages) {}

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
    if (storages_source_) {
      auto o = PyObject::make(PyObject::Kind::kStorage);
      o->tensor = storages_source_(key, dtype, numel);
      DDP_CHECK(o->tensor.scalar_type() == dtype && o->tensor.dim() == 1 && o->tensor.numel() == numel,
                fail("internal: the storage source gave a tensor of another dtype or length"));
      storages_[key] = o;
      return o;
    }
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
  const StorageSource& storages_source_;
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

c10::IValue unpickle_weights_only(const std::string& name, caffe2::serialize::PyTorchStreamReader& archive,
                                  const char* pickle, size_t size, const StorageSource& storages) {
  WeightsOnlyUnpickler unpickler(name, archive, pickle, size, storages);
  return Materializer(name, size).convert(unpickler.run());
}

}  // namespace ddp::detail
