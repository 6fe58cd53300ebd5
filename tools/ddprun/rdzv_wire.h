// What both sides of the rendezvous (rdzv_server.cpp, rdzv_client.cpp) speak: the framing of
// messages, socket I/O with deadlines, and the handshake's proofs over the job's secret.
//
// Every message is a list of strings, framed as
//   u32 total length | u32 count | (u32 length, bytes)*   (big-endian)
// A connection opens with HELLO protocol client-nonce, answered by challenge protocol
// server-nonce server-proof; then AUTH client-proof, answered by ok (or refused reason).
#pragma once

#include <netinet/in.h>
#include <signal.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "rdzv.h"

namespace ddprun::rdzv_wire {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMaxFrame = 1 << 20;  // a peer sending more is not one of ours
constexpr const char* kProtocol = "ddprun-rdzv-2";

Clock::time_point after(double seconds);
double seconds_between(Clock::time_point from, Clock::time_point to);
// For poll(2): the milliseconds left until `deadline`, 0 to 60 s.
int ms_until(Clock::time_point deadline);
// Seconds for a message, to 3 significant digits.
std::string fmt(double seconds);

std::string encode(const Message& message);
// 1: a whole frame was taken from the front of buffer; 0: need more bytes; -1: garbage.
int take_frame(std::string& buffer, Message* message);

// Numbers in messages: a peer's garbage reads as `fallback` (or 0), never throws.
int to_int(const std::string& text, int fallback = 0);
long long to_ll(const std::string& text);

// IPv4 address of `host` (a dotted quad or a name). Throws std::runtime_error.
in_addr resolve_ipv4(const std::string& host);
std::string address_text(const in_addr& address);

// Sends `message` on the connected socket `fd` and reads one reply, both by `deadline`.
// False if the connection broke, the deadline passed, or the reply was not a frame.
bool exchange(int fd, const Message& message, Message* reply, Clock::time_point deadline);

// The handshake's proofs: each side MACs both nonces, the store's fresh per connection, so
// that a recorded answer is worth nothing on another one; the prefixes keep the store's proof
// from serving as a client's.
std::string server_proof(const std::string& secret, const std::string& client_nonce, const std::string& server_nonce);
std::string client_proof(const std::string& secret, const std::string& server_nonce, const std::string& client_nonce);

// Blocks every signal in the threads started while it lives: the launcher's signal pipe is
// read by the main thread, and the helpers must never run its handlers.
class BlockSignalsForNewThreads {
 public:
  BlockSignalsForNewThreads() {
    sigset_t all;
    sigfillset(&all);
    ::pthread_sigmask(SIG_BLOCK, &all, &previous_);
  }
  ~BlockSignalsForNewThreads() { ::pthread_sigmask(SIG_SETMASK, &previous_, nullptr); }
  BlockSignalsForNewThreads(const BlockSignalsForNewThreads&) = delete;
  BlockSignalsForNewThreads& operator=(const BlockSignalsForNewThreads&) = delete;

 private:
  sigset_t previous_;
};

}  // namespace ddprun::rdzv_wire
