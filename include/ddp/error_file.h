#pragma once

// Records a worker's first error where its launcher looks for it, as
// torchrun's @record decorator does in Python: a JSON file named by
// TORCHELASTIC_ERROR_FILE (set per worker by torchrun and ddprun),
//
//   {"message": {"message": "...", "extraInfo": {"py_callstack": "...", "timestamp": "<unix s>"}},
//    "ddp": {"timestamp_ns": <unix ns>, "consequence": false, "rank": "1", "pid": 4242}}
//
// The launcher then names the earliest original error of the job as its root
// cause, not whichever worker happened to exit first. report_failure() does
// that and prints the message, from main()'s catch block:
//
//   } catch (const std::exception& e) {
//     return ddp::report_failure(e);
//   }

#include <ddp/export.h>
#include <exception>
#include <string>

namespace ddp {

/// Writes `error` to TORCHELASTIC_ERROR_FILE unless the variable is unset or
/// this process already recorded an error there (the first one is kept).
/// c10::Error's message goes without its backtrace. "consequence" is true
/// for a ddp::PeerFailure and false for any other ddp::Error (error.h);
/// other exceptions are judged by their text (launch_errors.h). Never
/// throws; returns whether it wrote the file.
DDP_API bool record_error(const std::exception& error) noexcept;
/// The same for a message, judged by its text.
DDP_API bool record_error(const std::string& message) noexcept;

/// The whole of a program's failure path, for main()'s catch block:
/// records `error` (record_error), prints "error: <message>" to stderr
/// without a C++ backtrace (LibTorch's c10::Error included), and returns 1
/// for main() to return.
///
///   } catch (const std::exception& e) {
///     return ddp::report_failure(e);
///   }
DDP_API int report_failure(const std::exception& error) noexcept;

}  // namespace ddp
