#pragma once

// Internal, not API: reading torch.save's data.pkl without running anything.
// Only what a weights-only pickle builds (None, bools, ints, floats, strings,
// tuples, lists, dicts, tensors over the archive's storages) is accepted;
// any other global is refused. The values built are bounded by the pickle's
// size, so a small hostile pickle cannot expand to gigabytes.

#include <ATen/core/ivalue.h>

#include <cstddef>
#include <functional>
#include <string>

namespace caffe2::serialize {
class PyTorchStreamReader;
}

namespace ddp::detail {

/// Where a storage's `numel` elements of `dtype` come from, given its record
/// key (data/<key>); a 1-D tensor of that dtype and length.
using StorageSource = std::function<at::Tensor(const std::string& key, c10::ScalarType dtype, int64_t numel)>;

/// The value `pickle` (data.pkl of `archive`, `size` bytes) describes; its
/// tensors' storages are read from `archive`'s data/ records, or, with
/// `storages`, taken from it (FSDP's file load gives meta tensors, to learn
/// where each tensor lies without reading it). Throws a ddp::Error naming
/// `name` for anything a weights-only load refuses.
c10::IValue unpickle_weights_only(const std::string& name, caffe2::serialize::PyTorchStreamReader& archive,
                                  const char* pickle, size_t size, const StorageSource& storages = {});

}  // namespace ddp::detail
