// safetensors files as DCP's HuggingFace storage writes and reads them; see
// safetensors_io.h.

#include "checkpoint/safetensors_io.h"

#include "common/atomic_file.h"

#include <ddp/error.h>

#include <ATen/Functions.h>
#include <c10/util/irange.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <functional>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <optional>
#include <set>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace ddp::detail {
namespace {

using Json = nlohmann::json;

// The dtypes DCP's reader maps (torch/distributed/checkpoint/_hf_utils.py),
// plus BOOL, which safetensors has.
const std::vector<std::pair<at::ScalarType, std::string>>& dtype_names() {
  static const std::vector<std::pair<at::ScalarType, std::string>> names = {
      {at::kFloat, "F32"}, {at::kDouble, "F64"}, {at::kHalf, "F16"},  {at::kBFloat16, "BF16"}, {at::kLong, "I64"},
      {at::kInt, "I32"},   {at::kShort, "I16"},  {at::kChar, "I8"},   {at::kByte, "U8"},       {at::kBool, "BOOL"}};
  return names;
}

std::string dtype_name(at::ScalarType dtype) {
  for (const auto& [type, name] : dtype_names()) {
    if (type == dtype) return name;
  }
  DDP_CHECK(false, "ddp: a distributed checkpoint cannot store dtype ", dtype,
            "; convert the tensor to a float or integer dtype first");
  return "";
}

std::optional<at::ScalarType> dtype_of(const std::string& name) {
  for (const auto& [type, spelled] : dtype_names()) {
    if (spelled == name) return type;
  }
  return std::nullopt;
}

// Sizes and offsets read from a file are at most this, so no sum or product
// of them below can overflow (2^40 elements: 4 TiB of float32 in one tensor).
constexpr int64_t kMaxExtent = int64_t{1} << 40;
// safetensors' own limit on a header.
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;

// The product of `sizes` (each in [0, kMaxExtent]), or -1 past kMaxExtent.
int64_t bounded_volume(const std::vector<int64_t>& sizes) {
  int64_t n = 1;
  for (int64_t s : sizes) {
    if (s == 0) return 0;
    if (n > kMaxExtent / s) return -1;
    n *= s;
  }
  return n;
}


// A JSON object of objects, each field a scalar or a list of integers: the
// shape of a safetensors header ({"name": {"dtype": "F32", "shape": [2, 3],
// "data_offsets": [0, 24]}, "__metadata__": {"k": "v"}}) and of
// DCP_SHARDING_INFO ({"name": {"saved_offsets": [0, 0]}}). It is read as it
// streams (nlohmann's SAX interface), keeping only each record's strings and
// lists, handed to `on_record` as soon as the record ends, so nothing is
// built that the index will not keep. Anything deeper, a list of more than
// `max_list` numbers, or a number that is not a size in [0, kMaxExtent]
// stops the parse at once with `problem` set: a hostile header costs memory
// in proportion to its own text: at most about five times it, for what the
// index keeps of many small entries, or for the lexer's copies of one long
// string as it builds it.
struct JsonRecord {
  std::map<std::string, std::string> strings;
  std::map<std::string, std::vector<int64_t>> lists;
};

class BoundedRecordsReader {
 public:
  using Json = nlohmann::json;
  using OnRecord = std::function<void(const std::string& name, JsonRecord&& record)>;

  BoundedRecordsReader(size_t max_list, OnRecord on_record) : max_list_(max_list), on_record_(std::move(on_record)) {}

  const std::string& problem() const { return problem_; }

  bool null() { return scalar(); }
  bool boolean(bool) { return scalar(); }
  bool number_float(double, const std::string&) {
    if (depth_ == 3) return refuse("its entry '" + name_ + "' has a " + field_ + " that is not a list of sizes");
    return scalar();
  }
  bool number_integer(int64_t value) {
    if (depth_ == 3) {
      if (value < 0) return refuse("its entry '" + name_ + "' has a " + field_ + " that is not a list of sizes");
      return element(static_cast<uint64_t>(value));
    }
    return scalar();
  }
  bool number_unsigned(uint64_t value) {
    if (depth_ == 3) return element(value);
    return scalar();
  }
  bool string(std::string& value) {
    if (depth_ == 3) return refuse("its entry '" + name_ + "' has a " + field_ + " that is not a list of sizes");
    if (depth_ == 2) {
      record_.strings[field_] = std::move(value);
      return true;
    }
    return scalar();
  }
  bool binary(Json::binary_t&) { return refuse("it holds binary data"); }
  bool key(std::string& value) {
    if (depth_ == 1) name_ = std::move(value);
    else field_ = std::move(value);
    return true;
  }
  bool start_object(size_t) {
    if (depth_ == 0 || depth_ == 1) {
      ++depth_;
      return true;
    }
    return refuse("its entry '" + name_ + "' nests deeper than a safetensors header does");
  }
  bool end_object() {
    if (--depth_ == 1) {
      on_record_(name_, std::move(record_));
      record_ = JsonRecord();
    }
    return true;
  }
  bool start_array(size_t) {
    if (depth_ == 0) return refuse("it is not a JSON object");
    if (depth_ == 1) return refuse("its entry '" + name_ + "' is not an object");
    if (depth_ == 3) return refuse("its entry '" + name_ + "' nests deeper than a safetensors header does");
    ++depth_;
    list_ = &record_.lists[field_];
    if (!list_->empty()) return refuse("its entry '" + name_ + "' has two " + field_ + " lists");
    return true;
  }
  bool end_array() {
    --depth_;
    list_ = nullptr;
    return true;
  }
  bool parse_error(size_t position, const std::string&, const nlohmann::detail::exception&) {
    return refuse("it is not a JSON object (a syntax error at byte " + std::to_string(position) + ")");
  }

 private:
  bool scalar() {
    if (depth_ == 0) return refuse("it is not a JSON object");
    if (depth_ == 1) return refuse("its entry '" + name_ + "' is not an object");
    return true;  // a field of no interest (a number in __metadata__, say)
  }
  bool element(uint64_t value) {
    if (list_->size() == max_list_) {
      return refuse("its entry '" + name_ + "' has a " + field_ + " of more than " + std::to_string(max_list_) +
                    " numbers");
    }
    if (value > static_cast<uint64_t>(kMaxExtent)) {
      return refuse("its entry '" + name_ + "' has a " + field_ + " with a number past 2^40");
    }
    list_->push_back(static_cast<int64_t>(value));
    return true;
  }
  bool refuse(std::string problem) {
    if (problem_.empty()) problem_ = std::move(problem);
    return false;
  }

  const size_t max_list_;
  OnRecord on_record_;
  int depth_ = 0;  // 1 inside the outer object, 2 in a record, 3 in a list
  std::string name_, field_;
  JsonRecord record_;
  std::vector<int64_t>* list_ = nullptr;
  std::string problem_;
};

void read_exactly(int fd, char* data, size_t size, int64_t offset, const std::string& path) {
  while (size > 0) {
    ssize_t n = ::pread(fd, data, size, offset);
    if (n < 0 && errno == EINTR) continue;
    DDP_CHECK(n > 0, "ddp: reading '", path, "' failed at byte ", offset, ": ",
              n == 0 ? std::string("the file ends early (truncated?)") : std::string(std::strerror(errno)));
    data += n;
    size -= static_cast<size_t>(n);
    offset += n;
  }
}

}  // namespace

int64_t element_count(const std::vector<int64_t>& sizes) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> boxes_of_flat_range(
    int64_t begin, int64_t end, const std::vector<int64_t>& shape) {
  std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> boxes;
  if (begin >= end) return boxes;
  if (shape.size() <= 1) {
    // A scalar is one element at no offsets; a vector's range is one box.
    if (shape.empty()) return {{{}, {}}};
    return {{{begin}, {end - begin}}};
  }
  const std::vector<int64_t> inner_shape(shape.begin() + 1, shape.end());
  const int64_t row = element_count(inner_shape);
  auto within_row = [&](int64_t r, int64_t from, int64_t to) {
    for (auto [offsets, sizes] : boxes_of_flat_range(from, to, inner_shape)) {
      offsets.insert(offsets.begin(), r);
      sizes.insert(sizes.begin(), 1);
      boxes.emplace_back(std::move(offsets), std::move(sizes));
    }
  };
  int64_t first_row = begin / row;
  const int64_t last_row = end / row;  // the row holding `end`, if partial
  if (first_row == last_row) {
    within_row(first_row, begin - first_row * row, end - first_row * row);
    return boxes;
  }
  if (begin % row != 0) within_row(first_row++, begin % row, row);
  if (last_row > first_row) {
    std::vector<int64_t> offsets(shape.size(), 0), sizes = shape;
    offsets[0] = first_row;
    sizes[0] = last_row - first_row;
    boxes.emplace_back(std::move(offsets), std::move(sizes));
  }
  if (end % row != 0) within_row(last_row, 0, end % row);
  return boxes;
}

void write_safetensors_file(const std::string& path, const std::vector<TensorBox>& boxes,
                            const std::map<std::string, std::string>& extra_metadata) {
  // nlohmann's json sorts keys; so does safetensors' own writer, and DCP's
  // reader does not care about order.
  Json header = Json::object();
  Json sharding = Json::object();
  std::vector<at::Tensor> contents;
  int64_t position = 0;
  for (const auto& box : boxes) {
    DDP_CHECK(!header.contains(box.key), "ddp: two boxes of '", box.key, "' in one checkpoint file");
    at::Tensor data = box.data.detach().to(at::kCPU).contiguous();
    const int64_t bytes = data.numel() * static_cast<int64_t>(data.element_size());
    header[box.key] = {{"dtype", dtype_name(data.scalar_type())},
                       {"shape", data.sizes().vec()},
                       {"data_offsets", {position, position + bytes}}};
    sharding[box.key] = {{"saved_offsets", box.offsets}};
    position += bytes;
    contents.push_back(std::move(data));
  }
  // What DCP's writer puts there (filesystem.py): the boxes' offsets as a
  // JSON string, its version and the framework.
  Json metadata = {{"DCP_SHARDING_INFO", sharding.dump()}, {"DCP_VERSION", "1.0"}, {"format", "pt"}};
  for (const auto& [name, value] : extra_metadata) metadata[name] = value;
  header["__metadata__"] = metadata;
  std::string text = header.dump();
  // safetensors pads the header with spaces to 8 bytes, so the data that
  // follows is aligned for zero-copy readers.
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t length = text.size();
  char length_bytes[8];
  for (int i = 0; i < 8; ++i) length_bytes[i] = static_cast<char>((length >> (8 * i)) & 0xff);

  // Through a temporary, as every checkpoint file: a link planted in a
  // shared directory under this name is refused rather than followed.
  write_file_atomically(path, [&](const ByteSink& sink) {
    sink(length_bytes, 8);
    sink(text.data(), text.size());
    for (const auto& data : contents) {
      sink(static_cast<const char*>(data.const_data_ptr()), data.numel() * data.element_size());
    }
  });
}

namespace {

// Parses `text` with `reader`; its problem (or a parse that stopped short)
// is an error naming `what`.
void parse_bounded(const std::string& text, BoundedRecordsReader& reader, const std::string& what) {
  const bool parsed = nlohmann::json::sax_parse(text, &reader, nlohmann::json::input_format_t::json, /*strict=*/true);
  DDP_CHECK(parsed && reader.problem().empty(), "ddp: ", what, " is refused: ",
            reader.problem().empty() ? std::string("it is not a JSON object") : reader.problem(),
            "; the file is damaged or was not written by DCP's HuggingFace storage");
}

}  // namespace

SafetensorsIndex::SafetensorsIndex(const std::string& dir) : dir_(dir) {
  namespace fs = std::filesystem;
  DDP_CHECK(fs::is_directory(dir), "ddp: no checkpoint directory '", dir, "'");
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_regular_file() && name.size() > 12 && name.compare(name.size() - 12, 12, ".safetensors") == 0) {
      files_.push_back(entry.path().string());
    }
  }
  std::sort(files_.begin(), files_.end());
  DDP_CHECK(!files_.empty(), "ddp: '", dir, "' holds no .safetensors file; it is not a distributed checkpoint");
  fds_.assign(files_.size(), -1);
  std::lock_guard<std::mutex> lock(open_mutex_);
  try {
    for (size_t f = 0; f < files_.size(); ++f) index_file(f);
  } catch (...) {
    for (int fd : fds_) {
      if (fd >= 0) ::close(fd);
    }
    throw;
  }
}

void SafetensorsIndex::index_file(size_t f) {
  const std::string& path = files_[f];
  const int fd = descriptor(f);
  struct stat info {};
  DDP_CHECK(::fstat(fd, &info) == 0, "ddp: cannot stat '", path, "': ", std::strerror(errno));
  identities_.emplace_back(static_cast<uint64_t>(info.st_dev), static_cast<uint64_t>(info.st_ino));
  const int64_t file_size = static_cast<int64_t>(info.st_size);
  DDP_CHECK(file_size >= 8, "ddp: '", path, "' is not a safetensors file (", file_size, " bytes)");
  unsigned char length_bytes[8];
  read_exactly(fd, reinterpret_cast<char*>(length_bytes), 8, 0, path);
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | length_bytes[i];
  DDP_CHECK(length <= static_cast<uint64_t>(file_size - 8) && length <= kMaxHeaderBytes, "ddp: '", path,
            "' declares a ", length, "-byte header but has ", file_size,
            " bytes (and a header may have at most 100 MiB): the file is truncated or not a safetensors file");
  std::string text(length, '\0');
  read_exactly(fd, text.data(), length, 8, path);
  const int64_t data_start = 8 + static_cast<int64_t>(length);

  // The header's records, checked one by one as the parse ends each and
  // kept at once in tensors_, so the index is the only copy. The boxes'
  // offsets are in __metadata__, which may come before or after them, so
  // this file's chunks are placed in their tensors once it is read.
  std::vector<std::pair<std::map<std::string, Tensor>::iterator, size_t>> added;
  std::string sharding_text;
  bool has_sharding = false;
  BoundedRecordsReader header(kMaxDimensions, [&](const std::string& key, JsonRecord&& entry) {
    if (key == "__metadata__") {
      for (auto& [name, value] : entry.strings) {
        if (name == "DCP_SHARDING_INFO") {
          sharding_text = std::move(value);
          has_sharding = true;
        } else {
          metadata_.emplace(name, std::move(value));
        }
      }
      return;
    }
    const char* problem = nullptr;
    auto dtype_name = entry.strings.find("dtype");
    auto shape = entry.lists.find("shape");
    auto range = entry.lists.find("data_offsets");
    Chunk chunk;
    chunk.file = f;
    if (dtype_name == entry.strings.end() || shape == entry.lists.end() || range == entry.lists.end() ||
        range->second.size() != 2) {
      problem = "lacks a dtype, shape or data_offsets";
    }
    if (!problem) {
      auto dtype = dtype_of(dtype_name->second);
      if (!dtype) problem = "has a dtype this library cannot read";
      else chunk.dtype = *dtype;
    }
    if (!problem) {
      chunk.sizes = std::move(shape->second);
      if (bounded_volume(chunk.sizes) < 0) problem = "has a shape of more than 2^40 elements";
    }
    int64_t begin = 0, end = 0;
    if (!problem) {
      begin = range->second[0];
      end = range->second[1];
      if (end < begin || end > file_size - data_start) {
        problem = "lies beyond the end of the file (truncated?)";
      } else if (end - begin != element_count(chunk.sizes) * static_cast<int64_t>(c10::elementSize(chunk.dtype))) {
        problem = "has a byte range that does not match its shape and dtype";
      }
    }
    auto tensor = tensors_.try_emplace(key).first;
    // This file's chunks are the last ones of their tensors.
    if (!problem && !tensor->second.chunks.empty() && tensor->second.chunks.back().file == f) {
      problem = "appears twice in the header";
    }
    DDP_CHECK(!problem, "ddp: tensor '", key, "' in '", path, "' ", problem,
              "; the file is damaged or was not written by DCP's HuggingFace storage");
    chunk.data_begin = data_start + begin;
    chunk.offsets.assign(chunk.sizes.size(), 0);
    tensor->second.chunks.push_back(std::move(chunk));
    added.emplace_back(tensor, tensor->second.chunks.size() - 1);
  });
  parse_bounded(text, header, "the header of '" + path + "'");
  text = std::string();

  std::map<std::string, std::vector<int64_t>> saved_offsets;
  std::set<std::string> lacking_offsets;
  if (has_sharding) {
    BoundedRecordsReader sharding(kMaxDimensions, [&](const std::string& key, JsonRecord&& info) {
      auto offsets = info.lists.find("saved_offsets");
      if (offsets == info.lists.end()) lacking_offsets.insert(key);
      else saved_offsets[key] = std::move(offsets->second);
    });
    parse_bounded(sharding_text, sharding, "DCP_SHARDING_INFO of '" + path + "'");
    sharding_text = std::string();
  }
  for (const auto& [tensor, index] : added) {
    const std::string& key = tensor->first;
    Chunk& chunk = tensor->second.chunks[index];
    auto offsets = saved_offsets.find(key);
    DDP_CHECK(!lacking_offsets.count(key) &&
                  (offsets == saved_offsets.end() || offsets->second.size() == chunk.sizes.size()),
              "ddp: the saved_offsets of '", key, "' in '", path, "' do not match its shape");
    if (offsets != saved_offsets.end()) chunk.offsets = offsets->second;
    std::vector<int64_t>& shape = tensor->second.shape;
    if (index == 0) shape.assign(chunk.sizes.size(), 0);
    DDP_CHECK(shape.size() == chunk.sizes.size(), "ddp: '", key, "' has boxes of different ranks in '", dir_, "'");
    for (size_t d = 0; d < chunk.sizes.size(); ++d) shape[d] = std::max(shape[d], chunk.offsets[d] + chunk.sizes[d]);
  }
}

SafetensorsIndex::~SafetensorsIndex() {
  for (int fd : fds_) {
    if (fd >= 0) ::close(fd);
  }
}

int SafetensorsIndex::descriptor(size_t file) const {
  auto used = std::find(open_files_.begin(), open_files_.end(), file);
  if (used != open_files_.end()) {
    open_files_.erase(used);
    open_files_.push_back(file);
    return fds_[file];
  }
  if (open_files_.size() >= kMaxOpenFiles) {
    ::close(fds_[open_files_.front()]);
    fds_[open_files_.front()] = -1;
    open_files_.erase(open_files_.begin());
  }
  const std::string& path = files_[file];
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  DDP_CHECK(fd >= 0, "ddp: cannot open '", path, "': ", std::strerror(errno),
            errno == EMFILE || errno == ENFILE
                ? " (this process has too many files open; raise the limit with ulimit -n, or close files)"
                : "");
  if (file < identities_.size()) {
    struct stat info {};
    const bool same = ::fstat(fd, &info) == 0 && static_cast<uint64_t>(info.st_dev) == identities_[file].first &&
                      static_cast<uint64_t>(info.st_ino) == identities_[file].second;
    if (!same) ::close(fd);
    DDP_CHECK(same, "ddp: '", path, "' was replaced while the checkpoint in '", dir_,
              "' was being loaded; is another job saving into that directory?");
  }
  fds_[file] = fd;
  open_files_.push_back(file);
  return fd;
}

std::vector<std::string> SafetensorsIndex::keys_with_prefix(const std::string& prefix) const {
  std::vector<std::string> keys;
  for (auto it = tensors_.lower_bound(prefix); it != tensors_.end() && it->first.rfind(prefix, 0) == 0; ++it) {
    keys.push_back(it->first);
  }
  return keys;
}

std::vector<int64_t> SafetensorsIndex::shape_of(const std::string& key) const {
  auto it = tensors_.find(key);
  DDP_CHECK(it != tensors_.end(), "ddp: the checkpoint in '", dir_, "' has no '", key, "'");
  return it->second.shape;
}

int64_t SafetensorsIndex::data_bytes() const {
  int64_t total = 0;
  for (const auto& [key, tensor] : tensors_) {
    for (const auto& chunk : tensor.chunks) total += element_count(chunk.sizes) * static_cast<int64_t>(c10::elementSize(chunk.dtype));
  }
  return total;
}

std::string SafetensorsIndex::metadata(const std::string& name) const {
  auto it = metadata_.find(name);
  return it == metadata_.end() ? std::string() : it->second;
}

void SafetensorsIndex::read_into(TensorBox& box) const {
  auto it = tensors_.find(box.key);
  DDP_CHECK(it != tensors_.end(), "ddp: the checkpoint in '", dir_, "' has no '", box.key,
            "'; was it saved from another model, or without the optimizer?");
  const auto want_sizes = box.data.sizes().vec();
  const size_t rank = want_sizes.size();
  DDP_CHECK(rank == it->second.shape.size(), "ddp: '", box.key, "' has ", it->second.shape.size(),
            " dimensions in the checkpoint but ", rank, " in the model");
  int64_t covered = 0;
  // The overlaps read so far: two boxes of one tensor must not share an
  // element, or `covered` could add up while some element is never read.
  std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> read_boxes;
  for (const Chunk& chunk : it->second.chunks) {
    // The overlap of the wanted box and this chunk, in whole-tensor indices.
    std::vector<int64_t> lo(rank), size(rank);
    bool empty = false;
    for (size_t d = 0; d < rank; ++d) {
      lo[d] = std::max(box.offsets[d], chunk.offsets[d]);
      const int64_t hi = std::min(box.offsets[d] + want_sizes[d], chunk.offsets[d] + chunk.sizes[d]);
      size[d] = hi - lo[d];
      empty = empty || size[d] <= 0;
    }
    if (empty) continue;
    for (const auto& [other_lo, other_size] : read_boxes) {
      bool disjoint = false;
      for (size_t d = 0; d < rank; ++d) {
        disjoint = disjoint || lo[d] + size[d] <= other_lo[d] || other_lo[d] + other_size[d] <= lo[d];
      }
      DDP_CHECK(disjoint, "ddp: the checkpoint in '", dir_,
                "' stores some elements of '", box.key, "' twice (overlapping boxes); the files are damaged or mixed");
    }
    read_boxes.emplace_back(lo, size);
    // Read it as runs that are contiguous in the file: the dimensions after
    // `split` are whole in the chunk, so each run is size[split] of them.
    size_t split = rank == 0 ? 0 : rank - 1;
    while (split > 0 && size[split] == chunk.sizes[split]) --split;
    std::vector<int64_t> strides(rank, 1);
    for (size_t d = rank; d-- > 1;) strides[d - 1] = strides[d] * chunk.sizes[d];
    const int64_t element = static_cast<int64_t>(c10::elementSize(chunk.dtype));
    const int64_t run = rank == 0 ? 1 : size[split] * strides[split];
    at::Tensor staged = at::empty(size, at::TensorOptions().dtype(chunk.dtype));
    char* out = static_cast<char*>(staged.data_ptr());
    std::vector<int64_t> index(split, 0);  // over dimensions [0, split)
    while (true) {
      int64_t first = 0;
      for (size_t d = 0; d < rank; ++d) {
        first += ((d < split ? index[d] : 0) + lo[d] - chunk.offsets[d]) * strides[d];
      }
      {
        std::lock_guard<std::mutex> lock(open_mutex_);
        read_exactly(descriptor(chunk.file), out, run * element, chunk.data_begin + first * element,
                     files_[chunk.file]);
      }
      out += run * element;
      bytes_read_ += run * element;
      size_t d = split;
      while (d > 0 && ++index[d - 1] == size[d - 1]) index[--d] = 0;
      if (d == 0) break;
    }
    at::Tensor target = box.data;
    for (size_t d = 0; d < rank; ++d) target = target.narrow(d, lo[d] - box.offsets[d], size[d]);
    target.copy_(staged);
    covered += element_count(size);
  }
  DDP_CHECK(covered == element_count(want_sizes), "ddp: the checkpoint in '", dir_, "' covers only ", covered, " of the ",
            element_count(want_sizes), " elements of '", box.key, "' this rank needs; a file is missing");
}

}  // namespace ddp::detail
