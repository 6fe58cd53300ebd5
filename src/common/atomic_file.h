#pragma once

// Internal to src/, not installed: how every file ddp writes into a
// checkpoint directory comes into being. Defined in checkpoint.cpp.
//
// A checkpoint directory may be shared, so anyone who can write there can
// plant a symbolic link named like the file a job will write next. The
// temporary is therefore created under an unpredictable name with
// O_CREAT|O_EXCL|O_NOFOLLOW (a planted name is refused, never followed), and
// a final path that is a link is refused, naming it.

#include <cstddef>
#include <functional>
#include <string>

namespace ddp::detail {

/// Appends bytes to the file being written; throws a ddp::Error naming the
/// file if the write fails.
using ByteSink = std::function<void(const char* data, size_t size)>;

/// Writes `path` atomically: `write` streams the contents into a fresh
/// temporary in the same directory, which is fsync'd and renamed over `path`,
/// then the directory is fsync'd. On any error the temporary is removed and
/// whatever was at `path` is left as it was.
void write_file_atomically(const std::string& path, const std::function<void(const ByteSink&)>& write);

}  // namespace ddp::detail
