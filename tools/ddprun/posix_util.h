// Small POSIX helpers shared by ddprun's pieces.
#pragma once

#include <sys/types.h>

#include <functional>
#include <string>

namespace ddprun {

// Writes all of data to fd, retrying on EINTR/EAGAIN. Returns false if the reader is gone
// (EPIPE) or the descriptor is broken; ddprun then drops the output rather than dying.
bool write_all(int fd, const char* data, size_t size);
bool write_all(int fd, const std::string& data);

// Writes "ddprun: <message>\n" to stderr as one line, never blocking (see console.h). Control
// characters in the message are escaped (printable()), so that no value it quotes can start a
// line of its own that reads like another worker's or ddprun's.
void say(const std::string& message);

// text with each control character (below 0x20, and 0x7f) written as C writes it: "\n", "\t",
// "\x1b". Text without any is returned as it is.
std::string printable(const std::string& text);

// Whether text holds a control character that printable() would escape.
bool has_control_character(const std::string& text);

// What a file of this st_mode is, for messages: "a regular file", "a symbolic link", "a FIFO"...
std::string file_type_name(unsigned mode);

// "SIGTERM" for 15; "signal 77" for numbers without a well-known name.
std::string signal_name(int signal_number);

// "exit code 3" or "killed by signal 11 (SIGSEGV)".
std::string describe_exit(int exit_code, int term_signal);

// A number of seconds as ddprun's messages write it, in std::ostream's default form: "5", "0.5".
std::string format_seconds(double seconds);

// Sets O_NONBLOCK on fd. Throws std::runtime_error.
void set_nonblocking(int fd);

// Makes sure descriptors 0, 1 and 2 are open (on /dev/null if they were closed), so pipes
// created later never land on them and get clobbered by dup2 in a child.
void ensure_standard_fds_open();

// fork() for a child that ddprun supervises. Every signal stays blocked across the fork, and in
// the child until `in_child` unblocks it: one arriving before the child has reset its
// dispositions would otherwise run ddprun's handler in the child and write into ddprun's signal
// pipe. The child gets its own process group, dies with ddprun even when ddprun is SIGKILLed and
// cannot clean up (PR_SET_PDEATHSIG), unless ddprun died before that took effect (then it exits
// at once), and takes `stdout_fd` as its standard output; then it runs `in_child`, which must
// exec or _exit. Returns the child's pid in the parent, or -1 with errno set.
pid_t fork_supervised_child(int stdout_fd, const std::function<void()>& in_child);

// Owns a file descriptor and closes it when destroyed; movable, not copyable.
class FileDescriptor {
 public:
  FileDescriptor() = default;
  explicit FileDescriptor(int fd) : fd_(fd) {}
  ~FileDescriptor() { reset(); }
  FileDescriptor(FileDescriptor&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  FileDescriptor& operator=(FileDescriptor&& other) noexcept;
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;

  int get() const { return fd_; }
  void reset();

 private:
  int fd_ = -1;
};

// A TCP port on 127.0.0.1 that nothing listens on right now (the kernel's
// choice). Throws std::runtime_error naming `what` if there is none.
int free_loopback_port(const std::string& what);

// std::runtime_error with "<what>: <strerror(errno)>".
[[noreturn]] void throw_errno(const std::string& what);

}  // namespace ddprun
