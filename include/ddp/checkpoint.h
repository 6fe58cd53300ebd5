#pragma once

// Checkpoints in the file format of Python's torch.save, so that
//   torch.load("model_final.pt")            # weights_only=True, the default
// reads what ddp writes, and ddp reads state dicts that Python saved with
//   torch.save(model.state_dict(), path)
// Loading never runs code from the file: it understands only the few pickle
// constructs a weights-only file contains, as Python's weights_only does.

#include <ddp/export.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace torch::nn {
class Module;
class AnyModule;
template <typename Contained>
class ModuleHolder;
}  // namespace torch::nn
namespace torch::jit {
struct Module;
}

namespace ddp {

/// Tensors by name, in order: what Python's model.state_dict() holds.
using StateDict = std::vector<std::pair<std::string, at::Tensor>>;

/// The parameters and buffers of `module`, by their dotted names, in the
/// order of Python's model.state_dict(): for each module (depth first, in
/// registration order) its own parameters, then its own buffers.
DDP_API StateDict state_dict(const torch::nn::Module& module);
/// The same for a TorchScript module (torch::jit::load's result).
DDP_API StateDict state_dict(const torch::jit::Module& module);

/// Copies `state` into `module`'s parameters and buffers. Every name must
/// exist on both sides with the same shape; the error names the first that
/// does not.
DDP_API void load_state_dict(torch::nn::Module& module, const StateDict& state);
DDP_API void load_state_dict(const torch::jit::Module& module, const StateDict& state);

/// One-call checkpoints: save(model, path) writes model's state dict (as
/// Python's torch.save(model.state_dict(), path) would; it loads with
/// torch.load(weights_only=True) and load_state_dict(strict=True)), and
/// load(model, path) reads one back, strictly. `model` is a module, a
/// ModuleHolder, a shared_ptr to a module, an AnyModule, a torch::jit::Module,
/// or a DistributedDataParallel (see distributed_data_parallel.h: it saves
/// from rank 0 only and loads on rank 0, then broadcasts).
DDP_API void save(const torch::nn::Module& module, const std::string& path);
DDP_API void save(const torch::jit::Module& module, const std::string& path);
DDP_API void save(const torch::nn::AnyModule& module, const std::string& path);
DDP_API void load(torch::nn::Module& module, const std::string& path);
DDP_API void load(const torch::jit::Module& module, const std::string& path);
DDP_API void load(torch::nn::AnyModule& module, const std::string& path);
template <typename Impl>
void save(const torch::nn::ModuleHolder<Impl>& module, const std::string& path) {
  save(*module, path);
}
template <typename Impl>
void load(torch::nn::ModuleHolder<Impl>& module, const std::string& path) {
  load(*module, path);
}
template <typename Impl>
void save(const std::shared_ptr<Impl>& module, const std::string& path) {
  save(*module, path);
}
template <typename Impl>
void load(const std::shared_ptr<Impl>& module, const std::string& path) {
  load(*module, path);
}

namespace detail {
/// Copies `state` into `targets` (a model's tensors): every name on both
/// sides, shapes equal; the error names the first that is not.
void copy_state_into(const StateDict& targets, const StateDict& state);
/// copy_state_into from the file at `path`; every error names the file.
void load_file_into(const StateDict& targets, const std::string& path);
}  // namespace detail

/// Writes `state` as a dict of tensors that torch.load reads. The write is
/// atomic: a temporary file is written and fsync'd, then renamed over `path`,
/// so a crash never leaves a half-written file where a good one was. The file
/// is streamed to disk as it is made, so a save needs little memory beyond
/// the tensors themselves (views are copied: only their own elements are
/// saved); running out of memory is an error naming the file and the size.
/// A `path` that is a symbolic link is refused, naming it.
DDP_API void save_state_dict(const StateDict& state, const std::string& path);

/// Reads a dict of tensors written by save_state_dict or by Python's
/// torch.save(state_dict). Throws, naming the file, if it is missing,
/// truncated, or holds anything but a dict of tensors.
DDP_API StateDict load_state_dict(const std::string& path);

/// Writes any value made of dicts, lists, tuples, strings, numbers, booleans,
/// None and tensors in torch.save's format, atomically, as save_state_dict
/// does. Typed lists (c10::List<at::Tensor>, of ints, doubles or bools) are
/// written as plain lists, which Python's weights-only torch.load reads.
DDP_API void save_value(const c10::IValue& value, const std::string& path);

/// Reads such a value (from C++ or Python). Dicts come back as GenericDicts
/// keyed by strings or ints; Python's OrderedDict becomes a plain dict.
DDP_API c10::IValue load_value(const std::string& path);

/// save_value's file contents, in memory.
DDP_API std::vector<char> serialize_value(const c10::IValue& value);
/// load_value from memory; `name` labels errors.
DDP_API c10::IValue deserialize_value(const std::vector<char>& bytes, const std::string& name);

/// Writes `bytes` to `path` atomically (temporary file, fsync, rename, fsync
/// of the directory). The temporary gets an unpredictable name and is created
/// only where nothing exists (O_EXCL|O_NOFOLLOW), so links planted in a shared
/// directory are never followed; a `path` that is a symbolic link is refused.
DDP_API void write_file_atomically(const std::string& path, const std::vector<char>& bytes);

}  // namespace ddp
