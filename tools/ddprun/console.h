// ddprun's own stdout and stderr, written without ever blocking: a console nobody reads (a pipe
// into a stuck program, a paused terminal) must not keep ddprun from handling signals, worker
// exits and the rendezvous. What the reader does not take yet waits in a bounded buffer; worker
// lines that do not fit are dropped and counted, and a note says how many once it can.
// Used by ddprun's main thread only.
#pragma once

#include <poll.h>

#include <string>
#include <vector>

namespace ddprun {

// Queues `lines` (whole lines) for ddprun's stdout or stderr (fd 1 or 2) and writes what the
// stream takes now. Worker output (own == false) beyond the buffer's bound is dropped, a whole
// line at a time; ddprun's own messages are kept up to a larger bound.
void console_write(int fd, const std::string& lines, bool own);

// Writes what the streams take now; never blocks.
void console_flush();

// Adds a POLLOUT entry for each stream with queued output, so that poll() wakes when it drains.
void console_add_poll_fds(std::vector<pollfd>& fds);

// Before ddprun exits: keeps writing while the readers take output, giving up once they took
// nothing for `stall_seconds`; then says how much worker output was dropped, on a stream that
// still takes it.
void console_finish(double stall_seconds);

}  // namespace ddprun
