#pragma once

// Checkpoints in the file format of Python's torch.save, so that
//   torch.load("model_final.pt")            # weights_only=True, the default
// reads what ddp writes, and ddp reads state dicts that Python saved with
//   torch.save(model.state_dict(), path)
// Loading never runs code from the file: it understands only the few pickle
// constructs a weights-only file contains, as Python's weights_only does.

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <string>
#include <utility>
#include <vector>

namespace torch::nn {
class Module;
}

namespace ddp {

/// Tensors by name, in order: what Python's model.state_dict() holds.
using StateDict = std::vector<std::pair<std::string, at::Tensor>>;

/// The parameters and buffers of `module`, by their dotted names.
StateDict state_dict(const torch::nn::Module& module);

/// Copies `state` into `module`'s parameters and buffers. Every name must
/// exist on both sides with the same shape; the error names the first that
/// does not.
void load_state_dict(torch::nn::Module& module, const StateDict& state);

/// Writes `state` as a dict of tensors that torch.load reads. The write is
/// atomic: a temporary file is written and fsync'd, then renamed over `path`,
/// so a crash never leaves a half-written file where a good one was.
void save_state_dict(const StateDict& state, const std::string& path);

/// Reads a dict of tensors written by save_state_dict or by Python's
/// torch.save(state_dict). Throws, naming the file, if it is missing,
/// truncated, or holds anything but a dict of tensors.
StateDict load_state_dict(const std::string& path);

/// Writes any value made of dicts, lists, tuples, strings, numbers, booleans,
/// None and tensors in torch.save's format, atomically.
void save_value(const c10::IValue& value, const std::string& path);

/// Reads such a value (from C++ or Python). Dicts come back as GenericDicts
/// keyed by strings or ints; Python's OrderedDict becomes a plain dict.
c10::IValue load_value(const std::string& path);

/// save_value's file contents, in memory.
std::vector<char> serialize_value(const c10::IValue& value);
/// load_value from memory; `name` labels errors.
c10::IValue deserialize_value(const std::vector<char>& bytes, const std::string& name);

/// Writes `bytes` to `path` atomically (temporary file, fsync, rename, fsync
/// of the directory).
void write_file_atomically(const std::string& path, const std::vector<char>& bytes);

}  // namespace ddp
