#pragma once

// Internal to src/, not installed: a torch.save file opened with the checks
// every ddp loader makes (not the legacy format, no record declared larger
// than the file, little-endian), for readers that then take only some of its
// records: FSDP's load_full_state_dict_file reads each rank's bytes straight
// from the data/ records (src/sharding/fsdp_full_state_file.cpp). Defined in
// checkpoint.cpp.

#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>

#include <memory>
#include <string>

namespace ddp::detail {

/// Opens the archive that `source` holds; errors are ddp::Errors that name
/// `name`.
std::unique_ptr<caffe2::serialize::PyTorchStreamReader> open_torch_save_file(
    const std::shared_ptr<caffe2::serialize::ReadAdapterInterface>& source, const std::string& name);

}  // namespace ddp::detail
