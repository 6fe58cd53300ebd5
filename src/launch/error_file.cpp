#include <ddp/error_file.h>

#include <ddp/error.h>
#include <ddp/launch_env.h>
#include <ddp/launch_errors.h>

#include "common/atomic_file.h"
#include "common/json_text.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace ddp {
namespace {

// `consequence`: the error is a consequence of another process's failure.
bool write_record(const std::string& message, bool consequence) noexcept {
  try {
    const char* path = std::getenv(launch_env::kErrorFile);
    if (path == nullptr || *path == '\0') return false;
    struct stat info {};
    if (::stat(path, &info) == 0 && info.st_size > 0) return false;  // the first error is kept
    auto now = std::chrono::system_clock::now().time_since_epoch();
    long long seconds = std::chrono::duration_cast<std::chrono::seconds>(now).count();
    long long nanoseconds = std::chrono::duration_cast<std::chrono::nanoseconds>(now).count();
    const char* rank = std::getenv(launch_env::kRank);
    // torchrun's layout (its @record decorator writes the "message" object),
    // plus ddp's own object that torchrun ignores.
    const detail::OrderedJson extra_info = {{"py_callstack", "(a C++ program: no Python stack)"},
                                            {"timestamp", std::to_string(seconds)}};
    const detail::OrderedJson record = {
        {"message", {{"message", message}, {"extraInfo", extra_info}}},
        {"ddp", {{"timestamp_ns", nanoseconds}, {"consequence", consequence}, {"rank", rank ? rank : ""},
                 {"pid", ::getpid()}}},
    };
    const std::string json = detail::python_style_json(record) + "\n";
    // Written whole under a fresh name, then renamed (a launcher never reads
    // half a file), and never through a link planted at either name.
    detail::write_file_atomically(path, [&](const detail::ByteSink& sink) { sink(json.data(), json.size()); });
    return true;
  } catch (...) {
    return false;
  }
}

}  // namespace

bool record_error(const std::exception& error) noexcept {
  try {
    // ddp's own errors say by their type whether another rank caused them;
    // only other exceptions (LibTorch's, Gloo's, the program's) are judged
    // by their text.
    if (const auto* ddp_error = dynamic_cast<const Error*>(&error)) {
      return write_record(ddp_error->what_without_backtrace(), dynamic_cast<const PeerFailure*>(&error) != nullptr);
    }
    std::string message;
    if (const auto* c10_error = dynamic_cast<const c10::Error*>(&error)) {
      message = c10_error->what_without_backtrace();
    } else {
      message = error.what();
    }
    return write_record(message, launch_errors::reads_like_consequence(message));
  } catch (...) {
    return false;
  }
}

bool record_error(const std::string& message) noexcept {
  try {
    return write_record(message, launch_errors::reads_like_consequence(message));
  } catch (...) {
    return false;
  }
}

int report_failure(const std::exception& error) noexcept {
  record_error(error);
  const auto* torch_error = dynamic_cast<const c10::Error*>(&error);
  const char* message = torch_error ? torch_error->what_without_backtrace() : error.what();
  std::fprintf(stderr, "error: %s\n", message);
  std::fflush(stderr);
  return 1;
}

}  // namespace ddp
