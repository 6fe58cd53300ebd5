#pragma once

// Internal to src/: the files of a distributed checkpoint, in the layout of
// PyTorch DCP's HuggingFace storage (torch.distributed.checkpoint
// HuggingFaceStorageWriter with save_distributed=True, and its reader). Each
// file is a safetensors file: 8 bytes of little-endian header length, a JSON
// header naming each tensor's dtype, shape and byte range, then the raw
// bytes. A tensor split over ranks is stored as boxes ("chunks"): each file
// holds at most one box per name, and the header's __metadata__ records
// where each box lies in the whole tensor (DCP_SHARDING_INFO's
// saved_offsets). The whole tensor's shape is the union of its boxes.
//
// Reading needs only the headers and the bytes of the boxes asked for, so a
// rank reads its own part of a checkpoint written at any world size.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace ddp::detail {

/// A box of the tensor `key`: `data` (contiguous, its sizes the box's)
/// holds the tensor's elements [offsets, offsets + data.sizes()).
struct TensorBox {
  std::string key;
  std::vector<int64_t> offsets;
  at::Tensor data;
};

/// The product of `sizes`: a shape's element count (1 for a scalar).
int64_t element_count(const std::vector<int64_t>& sizes);

/// Where the elements [begin, end) of a row-major tensor of `shape` lie, as
/// boxes each of which is itself a contiguous run of those elements, in
/// order: for a matrix, a partial first row, whole rows, a partial last row.
/// Returns (offsets, sizes) per box; none for an empty range.
std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> boxes_of_flat_range(
    int64_t begin, int64_t end, const std::vector<int64_t>& shape);

/// Writes `boxes` (no two with the same key) as one safetensors file at
/// `path`, fsynced, with `extra_metadata` added to its __metadata__.
void write_safetensors_file(const std::string& path, const std::vector<TensorBox>& boxes,
                            const std::map<std::string, std::string>& extra_metadata = {});

/// The headers of every *.safetensors file in a directory: which boxes of
/// which tensors it holds. Reads the boxes a rank asks for.
class SafetensorsIndex {
 public:
  /// The most sizes a shape may have: far more than any model's tensor has,
  /// and few enough that a shape list cannot be a memory bomb.
  static constexpr size_t kMaxDimensions = 64;
  /// The most files held open at once.
  static constexpr size_t kMaxOpenFiles = 32;

  /// Parses every header; a malformed or truncated file is an error naming
  /// it. A directory without any *.safetensors file is an error too. A header
  /// is parsed as it streams, into only what the index keeps, and refused as
  /// soon as it nests deeper or holds longer lists than a safetensors header
  /// can (kMaxDimensions sizes per shape), so a hostile header costs memory
  /// in proportion to its own size. Files are opened as they are read, at
  /// most kMaxOpenFiles at once, so a checkpoint of thousands of files loads
  /// under a low limit on open files.
  explicit SafetensorsIndex(const std::string& dir);
  ~SafetensorsIndex();
  SafetensorsIndex(const SafetensorsIndex&) = delete;
  SafetensorsIndex& operator=(const SafetensorsIndex&) = delete;

  bool contains(const std::string& key) const { return tensors_.count(key) != 0; }
  /// The keys that start with `prefix`, sorted.
  std::vector<std::string> keys_with_prefix(const std::string& prefix) const;
  /// The whole tensor's shape (the union of its boxes).
  std::vector<int64_t> shape_of(const std::string& key) const;
  /// A string stored in some file's __metadata__ under `name`; "" if none.
  std::string metadata(const std::string& name) const;
  /// Every such string but DCP_SHARDING_INFO.
  const std::map<std::string, std::string>& all_metadata() const { return metadata_; }
  /// Copies the elements of tensor `box.key` at [box.offsets, + box sizes)
  /// into box.data (converting the dtype if it differs), reading only their
  /// bytes. Every element must be in the checkpoint.
  void read_into(TensorBox& box) const;
  /// Bytes read from data sections so far (headers excluded).
  int64_t bytes_read() const { return bytes_read_; }
  /// The data bytes of every file together.
  int64_t data_bytes() const;

 private:
  struct Chunk {
    size_t file;
    std::vector<int64_t> offsets, sizes;
    at::ScalarType dtype;
    int64_t data_begin;  // the chunk's first byte in its file
  };
  struct Tensor {
    std::vector<int64_t> shape;
    std::vector<Chunk> chunks;
  };
  /// Reads files_[file]'s header into tensors_ and metadata_. Call with
  /// open_mutex_ held.
  void index_file(size_t file);
  /// The file descriptor of files_[file], opened if need be (closing the
  /// least recently used one past kMaxOpenFiles). Call with open_mutex_ held.
  int descriptor(size_t file) const;

  std::string dir_;
  std::vector<std::string> files_;
  // Which file each index was made from: a file replaced since then is an
  // error, not a read of other bytes at the same offsets.
  std::vector<std::pair<uint64_t, uint64_t>> identities_;  // (st_dev, st_ino)
  mutable std::mutex open_mutex_;
  mutable std::vector<int> fds_;              // per file; -1 while closed
  mutable std::vector<size_t> open_files_;    // least recently used first
  std::map<std::string, Tensor> tensors_;
  std::map<std::string, std::string> metadata_;
  mutable int64_t bytes_read_ = 0;
};

}  // namespace ddp::detail
