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
  bool consequence = false;    // ddp.consequence (a ddp program's), else looks_like_consequence(message)
};

// Reads a worker's error file; an absent, empty or unreadable file gives present == false.
// Never throws.
ErrorRecord read_error_record(const std::string& path);

// Whether an error message describes a consequence of another process's failure: a connection
// closed or reset by a peer, a timeout waiting for peers, a rendezvous another rank stopped.
// For error files without ddp's "ddp" object (programs that are not ddp programs): ddp marks
// its own errors by their type (ddp::PeerFailure).
bool looks_like_consequence(const std::string& message);

// Whether an output line reads like an error message ("error: ...", "RuntimeError: ...",
// "terminate called ...") rather than a stack frame or ordinary output.
bool is_error_line(const std::string& line);

// Whether an output line is a frame of a printed C++ or Python stack trace ("frame #15: ...",
// "Exception raised from ...").
bool is_stack_frame_line(const std::string& line);

}  // namespace ddprun
