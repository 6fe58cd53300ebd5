// The error files workers leave for their launcher (torchrun's TORCHELASTIC_ERROR_FILE
// convention), and how ddprun tells an original error from a consequence of another
// worker's failure.
#pragma once

#include <string>

namespace ddprun {

struct ErrorRecord {
  bool present = false;    // the file existed and held a message
  std::string message;     // message.message (torchrun's layout), or a plain "message"
  long long timestamp_ns = 0;  // ddp.timestamp_ns, else extraInfo.timestamp (seconds) * 1e9
  // ddp.consequence (a ddp program's), else judged by the message's text
  // (ddp::launch_errors::reads_like_consequence, <ddp/launch_errors.h>).
  bool consequence = false;
};

// Reads a worker's error file; an absent, empty, unreadable or malformed file gives
// present == false. Never throws.
ErrorRecord read_error_record(const std::string& path);

// Whether an output line reads like an error message ("error: ...", "RuntimeError: ...",
// "terminate called ...") rather than a stack frame or ordinary output.
bool is_error_line(const std::string& line);

// Whether an output line is a frame of a printed C++ or Python stack trace ("frame #15: ...",
// "Exception raised from ...").
bool is_stack_frame_line(const std::string& line);

}  // namespace ddprun
