#include <ddp/stack_dump.h>

#include <ddp/collective_trace.h>
#include <ddp/error.h>
#include <ddp/error_file.h>
#include <ddp/launch_env.h>
#include <ddp/process_group.h>

#include <c10/util/Exception.h>
#include <c10/util/Type.h>

#include <cxxabi.h>
#include <dirent.h>
#include <dlfcn.h>
#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

namespace ddp {
namespace {

// Each thread captures its own stack in a handler of this signal, one thread
// at a time; the dumping thread symbolises the addresses outside any handler.
const int kCaptureSignal = SIGRTMIN + 5;
constexpr int kMaxFrames = 64;

std::atomic<pid_t> capture_target{0};
std::atomic<int> capture_count{0};
std::atomic<bool> capture_done{false};
void* capture_frames[kMaxFrames];

int request_pipe[2] = {-1, -1};

std::mutex traces_mutex;
std::map<const void*, std::pair<const CollectiveTrace*, int>>& traces() {
  static auto* registry = new std::map<const void*, std::pair<const CollectiveTrace*, int>>();
  return *registry;
}
std::mutex dump_mutex;

pid_t this_thread_id() { return static_cast<pid_t>(::syscall(SYS_gettid)); }

void on_capture(int) {
  const int saved_errno = errno;
  if (capture_target.load() == this_thread_id()) {
    capture_count = ::backtrace(capture_frames, kMaxFrames);
    capture_done = true;
  }
  errno = saved_errno;
}

void on_request(int) {
  const int saved_errno = errno;
  char byte = 1;
  if (request_pipe[1] >= 0) (void)!::write(request_pipe[1], &byte, 1);
  errno = saved_errno;
}

std::string frame_text(void* address) {
  Dl_info info{};
  std::ostringstream out;
  out << address;
  if (::dladdr(address, &info) != 0) {
    if (info.dli_sname) {
      int status = 0;
      char* demangled = abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status);
      out << " " << (status == 0 && demangled ? demangled : info.dli_sname);
      std::free(demangled);
      out << "+0x" << std::hex
          << (reinterpret_cast<uintptr_t>(address) - reinterpret_cast<uintptr_t>(info.dli_saddr)) << std::dec;
    }
    if (info.dli_fname) {
      const char* slash = std::strrchr(info.dli_fname, '/');
      out << " (" << (slash ? slash + 1 : info.dli_fname) << ")";
    }
  }
  return out.str();
}

std::string thread_name(pid_t tid) {
  std::ifstream comm("/proc/self/task/" + std::to_string(tid) + "/comm");
  std::string name;
  std::getline(comm, name);
  return name;
}

std::vector<pid_t> thread_ids() {
  std::vector<pid_t> ids;
  if (DIR* dir = ::opendir("/proc/self/task")) {
    while (dirent* entry = ::readdir(dir)) {
      if (entry->d_name[0] == '.') continue;
      ids.push_back(static_cast<pid_t>(std::atoi(entry->d_name)));
    }
    ::closedir(dir);
  }
  return ids;
}

// Every dump needs the other threads to answer kCaptureSignal, whose
// default action would end the process: installed on the first dump or with
// the SIGUSR1 handler, whichever comes first, never merely with a group.
void install_capture_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    // backtrace() loads its unwinder on first use: do that now, outside any
    // signal handler.
    void* warm[2];
    ::backtrace(warm, 2);
    struct sigaction capture {};
    capture.sa_handler = on_capture;
    capture.sa_flags = SA_RESTART;
    sigemptyset(&capture.sa_mask);
    ::sigaction(kCaptureSignal, &capture, nullptr);
  });
}

void dumper_loop() {
  char byte;
  while (::read(request_pipe[0], &byte, 1) >= 0) {
    dump_stacks("signal received");
  }
}

}  // namespace

void dump_stacks(const std::string& reason) {
  install_capture_handler();
  std::lock_guard<std::mutex> lock(dump_mutex);
  std::ostringstream out;
  out << "ddp: stack dump of pid " << ::getpid() << " (" << reason << "); the program carries on\n";
  const pid_t self = this_thread_id();
  for (pid_t tid : thread_ids()) {
    std::vector<void*> frames;
    if (tid == self) {
      void* own[kMaxFrames];
      int n = ::backtrace(own, kMaxFrames);
      frames.assign(own, own + n);
    } else {
      capture_done = false;
      capture_count = 0;
      capture_target = tid;
      if (::syscall(SYS_tgkill, ::getpid(), tid, kCaptureSignal) == 0) {
        for (int i = 0; i < 100 && !capture_done; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
      capture_target = 0;
      if (capture_done) frames.assign(capture_frames, capture_frames + capture_count.load());
    }
    out << "  thread " << tid << " (" << thread_name(tid) << ")" << (tid == self ? ", dumping" : "") << ":\n";
    if (frames.empty()) out << "    (no stack: the thread did not answer)\n";
    // Leave out the capture itself: this function, or the signal handler
    // and the kernel's return trampoline.
    const size_t first = tid == self ? 1 : 2;
    for (size_t i = first; i < frames.size(); ++i) {
      out << "    #" << i - first << " " << frame_text(frames[i]) << "\n";
    }
  }
  {
    std::lock_guard<std::mutex> traces_lock(traces_mutex);
    for (const auto& [owner, entry] : traces()) {
      out << "  rank " << entry.second << "'s last collectives (last entered #" << entry.first->last_entered()
          << ", last completed #" << entry.first->last_completed() << "):\n";
      for (const auto& r : entry.first->recent(10)) {
        out << "    " << describe(r) << " "
            << (r.state == CollectiveRecord::State::kCompleted ? "completed"
                : r.state == CollectiveRecord::State::kFailed  ? "failed"
                                                               : "not finished")
            << "\n";
      }
    }
  }
  const std::string text = out.str();
  std::fwrite(text.data(), 1, text.size(), stderr);
  std::fflush(stderr);
}

bool install_stack_dump_handler(int signal) {
  if (const char* setting = std::getenv("DDP_STACK_DUMP_SIGNAL"); setting && std::string(setting) == "off") {
    return false;
  }
  static std::once_flag once;
  std::call_once(once, [signal] {
    install_capture_handler();
    if (::pipe(request_pipe) != 0) return;
    ::fcntl(request_pipe[0], F_SETFD, FD_CLOEXEC);
    ::fcntl(request_pipe[1], F_SETFD, FD_CLOEXEC);
    struct sigaction request {};
    request.sa_handler = on_request;
    request.sa_flags = SA_RESTART;
    sigemptyset(&request.sa_mask);
    ::sigaction(signal, &request, nullptr);
    std::thread(dumper_loop).detach();
  });
  return true;
}

namespace {

std::terminate_handler previous_terminate = nullptr;

// Gloo's transport threads report a protocol violation (a message of another
// size than the receiver posted, which is what ranks issuing different
// collectives produce) by throwing where nobody can catch it, so the process
// would abort with a bare "terminate called" and no rank or collective
// named. With a process group alive, the uncaught exception becomes ddp's
// error line, recorded for the launcher, and exit status 1. The transport is
// blamed only when the exception says it came from there (Gloo's throws
// carry their source file, .../gloo/transport/...; c10d's are DistErrors):
// any other exception that nobody caught, std::bad_alloc from a save, say,
// is described as what it is.
[[noreturn]] void on_terminate() {
  std::string what;
  bool from_transport = false;
  bool peer_failure = false;
  if (std::exception_ptr error = std::current_exception()) {
    std::string type = "an exception of unknown type";
    if (const std::type_info* info = abi::__cxa_current_exception_type()) type = c10::demangle(info->name());
    try {
      std::rethrow_exception(error);
    } catch (const c10::DistError& e) {
      what = e.what_without_backtrace();
      from_transport = true;
    } catch (const PeerFailure& e) {
      // Its type, not its text, tells the launcher that another rank caused it.
      what = e.what_without_backtrace();
      from_transport = what.find("gloo/") != std::string::npos;
      peer_failure = true;
    } catch (const c10::Error& e) {
      what = e.what_without_backtrace();
      from_transport = what.find("gloo/") != std::string::npos;
    } catch (const std::exception& e) {
      what = e.what();
      // Gloo's own exception types say nothing a user needs; others' do.
      from_transport = what.find("gloo/") != std::string::npos;
      if (!from_transport) what = type + ": " + what;
    } catch (...) {
      what = type;
    }
  }
  std::string in_flight;
  int rank = -1;
  {
    std::unique_lock<std::mutex> lock(traces_mutex, std::try_to_lock);
    if (lock.owns_lock()) {
      for (const auto& [owner, entry] : traces()) {
        rank = entry.second;
        const uint64_t completed = entry.first->last_completed();
        const uint64_t entered = entry.first->last_entered();
        for (uint64_t seq = completed + 1; seq <= entered && seq <= completed + 4; ++seq) {
          if (auto record = entry.first->find(seq)) in_flight += (in_flight.empty() ? "" : ", ") + describe(*record);
        }
        if (in_flight.empty()) in_flight = "none (last completed #" + std::to_string(completed) + ")";
      }
    }
  }
  if (what.empty() || rank < 0) {
    // Not an exception escaping a ddp job's thread: the default behaviour.
    if (previous_terminate) previous_terminate();
    std::abort();
  }
  const std::string end = std::string(".?!").find(what.back()) == std::string::npos ? ". " : " ";
  const std::string message =
      from_transport
          ? "ddp: rank " + std::to_string(rank) + ": the process group's transport failed in a background thread: " +
                what + end + "Collectives in flight on this rank: " + in_flight +
                ". This usually means the ranks issued different collectives (one rank skipped, added or reordered "
                "one, or passed another size or dtype); run with DDP_DEBUG=detail to stop at the first difference "
                "with both sides named."
          : "ddp: rank " + std::to_string(rank) + ": the process ended on an exception that nothing caught: " + what +
                end + "Collectives in flight on this rank: " + in_flight +
                ". Catch it where it was thrown (a thread's function must catch its own exceptions), or fix its "
                "cause.";
  if (peer_failure) {
    record_error(PeerFailure(message));
  } else {
    record_error(message);
  }
  std::fprintf(stderr, "error: %s\n", message.c_str());
  std::fflush(stderr);
  std::_Exit(1);
}

}  // namespace

bool default_diagnostic_handlers() {
  const char* text = std::getenv(launch_env::kDiagnosticHandlers);
  if (text == nullptr || *text == '\0') return false;
  std::string value(text);
  std::transform(value.begin(), value.end(), value.begin(), [](unsigned char c) { return std::tolower(c); });
  if (value == "1" || value == "on" || value == "true") return true;
  if (value == "0" || value == "off" || value == "false") return false;
  DDP_CHECK(false, "ddp: ", launch_env::kDiagnosticHandlers, "='", text,
            "' must be 1 (install the SIGUSR1 stack dump and the terminate handler) or 0 (leave SIGUSR1 and "
            "std::terminate to the program)");
  return false;
}

namespace detail {

void install_transport_failure_handler() {
  static std::once_flag once;
  std::call_once(once, [] { previous_terminate = std::set_terminate(on_terminate); });
}

void register_trace_for_dumps(const void* owner, const CollectiveTrace* trace, int rank) {
  std::lock_guard<std::mutex> lock(traces_mutex);
  traces()[owner] = {trace, rank};
}

void unregister_trace_for_dumps(const void* owner) {
  std::lock_guard<std::mutex> lock(traces_mutex);
  traces().erase(owner);
}

}  // namespace detail

}  // namespace ddp
