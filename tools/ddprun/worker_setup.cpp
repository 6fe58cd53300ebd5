#include "worker_setup.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <stdexcept>

#include "job.h"
#include "signal_pipe.h"
#include "std_spec.h"
#include "watchdog.h"

#include <ddp/launch_env.h>

extern char** environ;

namespace ddprun {
namespace {

// argv/envp view of strings; valid while `strings` lives.
std::vector<char*> c_string_array(const std::vector<std::string>& strings) {
  std::vector<char*> pointers;
  pointers.reserve(strings.size() + 1);
  for (const std::string& s : strings) pointers.push_back(const_cast<char*>(s.c_str()));
  pointers.push_back(nullptr);
  return pointers;
}

// Whoever can write into --log-dir can plant a symbolic link (or a FIFO, or a hard link) named
// like a file ddprun is about to write, and have the job overwrite its target. So below the
// log directory itself, every directory and file is reached with openat() relative to a
// directory descriptor and O_NOFOLLOW, and anything but what ddprun expects is refused by name.
[[noreturn]] void refuse_planted(const std::string& path, const std::string& what, const std::string& fix) {
  throw std::runtime_error("refusing to use '" + path + "': it is " + what +
                           ", which someone who can write into the log directory may have planted to make the job "
                           "overwrite another file; " + fix +
                           ", and give --log-dir a directory only you can write to (docs/security.md, \"Shared "
                           "directories\")");
}

// What is at dir_fd/name, not following a symbolic link: its st_mode, or 0 if nothing is.
unsigned entry_mode(int dir_fd, const std::string& name) {
  struct stat info {};
  if (::fstatat(dir_fd, name.c_str(), &info, AT_SYMLINK_NOFOLLOW) != 0) return 0;
  return info.st_mode;
}

// A directory ddprun writes into: the user's --log-dir (or a directory ddprun made with
// mkdtemp), whose own path may pass through links the user chose.
FileDescriptor open_directory(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw_errno("cannot open log directory '" + path + "'");
  return FileDescriptor(fd);
}

// parent_fd/name as a directory of this user's that nobody else can write into: made here, or
// one that an earlier run made. path names it in messages.
FileDescriptor open_own_subdirectory(int parent_fd, const std::string& name, const std::string& path) {
  const bool made = ::mkdirat(parent_fd, name.c_str(), 0755) == 0;
  if (!made && errno != EEXIST) throw_errno("cannot create log directory '" + path + "'");
  const int fd = ::openat(parent_fd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    const unsigned mode = entry_mode(parent_fd, name);
    if (mode != 0 && !S_ISDIR(mode)) refuse_planted(path, file_type_name(mode) + ", not a directory", "remove it");
    throw_errno("cannot open log directory '" + path + "'");
  }
  FileDescriptor directory(fd);
  struct stat info {};
  if (::fstat(fd, &info) != 0) throw_errno("cannot inspect log directory '" + path + "'");
  // What mkdirat just made is ours even if it shows another owner (root on a root-squashed NFS).
  if (!made && info.st_uid != ::geteuid()) {
    refuse_planted(path, "a directory of user id " + std::to_string(info.st_uid) + ", not this user's",
                   "remove it");
  }
  if (made) {
    // The umask may have granted the group write access; the job's files are checked one by
    // one, but the workers' own files (error files, traces) are not, so nobody else may add any.
    ::fchmod(fd, info.st_mode & 0755);
  } else if ((info.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    throw std::runtime_error("refusing to use log directory '" + path +
                             "': other users may write into it, and could plant links there that the job would "
                             "write through; run: chmod go-w '" + path + "' (docs/security.md, \"Shared directories\")");
  }
  return directory;
}

// dir_fd/name as an empty regular file of this user's, opened for appending (the lines of
// several workers may share it): created, or an earlier run's emptied. path names it.
FileDescriptor create_log_file(int dir_fd, const std::string& name, const std::string& path) {
  // A fresh file first: O_EXCL with O_NOFOLLOW creates it only where nothing, not even a
  // dangling link, is. O_NONBLOCK keeps a planted FIFO from blocking the open below.
  constexpr int kFlags = O_WRONLY | O_APPEND | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC;
  int fd = ::openat(dir_fd, name.c_str(), kFlags | O_CREAT | O_EXCL, 0644);
  if (fd >= 0) return FileDescriptor(fd);
  // An earlier run's log, or a plant: checked before anything of it is lost (so no O_TRUNC).
  if (errno == EEXIST) fd = ::openat(dir_fd, name.c_str(), kFlags);
  if (fd < 0) {
    const int saved = errno;
    const unsigned mode = entry_mode(dir_fd, name);
    if (mode != 0 && !S_ISREG(mode)) refuse_planted(path, file_type_name(mode), "remove it");
    errno = saved;
    throw_errno("cannot create log file '" + path + "'");
  }
  FileDescriptor file(fd);
  struct stat info {};
  if (::fstat(fd, &info) != 0) throw_errno("cannot inspect log file '" + path + "'");
  if (!S_ISREG(info.st_mode)) refuse_planted(path, file_type_name(info.st_mode), "remove it");
  if (info.st_nlink > 1) {
    refuse_planted(path, "a file with " + std::to_string(info.st_nlink) + " hard links (another name elsewhere)",
                   "remove it");
  }
  if (info.st_uid != ::geteuid()) {
    refuse_planted(path, "a file of user id " + std::to_string(info.st_uid) + ", not this user's", "remove it");
  }
  if (::ftruncate(fd, 0) != 0) throw_errno("cannot empty log file '" + path + "'");
  return file;
}

// A worker's error file from an earlier run goes before the worker starts. A symbolic link
// there is refused rather than removed: the job does not write through it, but the user should
// know that someone planted it.
void remove_stale_error_file(int dir_fd, const std::string& name, const std::string& path) {
  const unsigned mode = entry_mode(dir_fd, name);
  if (mode == 0) return;
  if (!S_ISREG(mode)) refuse_planted(path, file_type_name(mode), "remove it");
  if (::unlinkat(dir_fd, name.c_str(), 0) != 0 && errno != ENOENT) {
    throw_errno("cannot remove the earlier error file '" + path + "'");
  }
}

}  // namespace

std::string virtual_local_rank_device(int local_rank) {
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  if (visible == nullptr) return std::to_string(local_rank);
  // torchrun splits on ',' and strips each entry, nothing more.
  std::vector<std::string> devices;
  std::stringstream entries(visible);
  for (std::string entry; std::getline(entries, entry, ',');) devices.push_back(entry);
  if (std::string(visible).empty() || std::string(visible).back() == ',') devices.emplace_back();
  if (local_rank >= static_cast<int>(devices.size())) {
    throw std::invalid_argument("--virtual-local-rank gives each local rank one entry of CUDA_VISIBLE_DEVICES='" +
                                std::string(visible) + "', but local rank " + std::to_string(local_rank) +
                                " has none; lower --nproc-per-node or list more devices");
  }
  std::string device = devices[static_cast<size_t>(local_rank)];
  const size_t first = device.find_first_not_of(" \t");
  return first == std::string::npos ? "" : device.substr(first, device.find_last_not_of(" \t") - first + 1);
}

Environment Environment::inherited() {
  Environment environment;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    environment.entries_.emplace_back(*entry);
  }
  return environment;
}

void Environment::set(const std::string& key, const std::string& value) {
  const std::string key_prefix = key + "=";
  entries_.erase(std::remove_if(entries_.begin(), entries_.end(),
                                [&](const std::string& entry) {
                                  return entry.compare(0, key_prefix.size(), key_prefix) == 0;
                                }),
                 entries_.end());
  entries_.push_back(key_prefix + value);
}

std::string attempt_log_dir(const std::string& log_dir, int attempt) {
  return log_dir + "/attempt_" + std::to_string(attempt);
}

void create_directories(const std::string& path) {
  std::error_code error;
  std::filesystem::create_directories(path, error);
  if (error) {
    throw std::runtime_error("cannot create log directory '" + path + "': " + error.message());
  }
}

void Job::start_workers() {
  Environment shared = shared_environment_;
  shared.set(ddp::launch_env::kMasterAddr, assignment_.master_addr);
  shared.set(ddp::launch_env::kMasterPort, std::to_string(assignment_.master_port));
  shared.set(ddp::launch_env::kRestartCount, std::to_string(assignment_.restart_count));
  shared.set("DDPRUN_ATTEMPT", std::to_string(assignment_.attempt));
  shared.set(ddp::launch_env::kWorldSize, std::to_string(assignment_.world_size));
  shared.set(ddp::launch_env::kGroupRank, std::to_string(assignment_.node_rank));
  shared.set("GROUP_WORLD_SIZE", std::to_string(assignment_.nnodes));
  shared.set("ROLE_WORLD_SIZE", std::to_string(assignment_.world_size));
  if (options_.fault_tolerance) {
    // A replica is a group of --ft-replica-size workers, which never straddles two nodes.
    shared.set("DDP_FT_INITIAL_REPLICAS", std::to_string(assignment_.world_size / options_.ft_replica_size));
    shared.set("DDP_FT_REPLICA_SIZE", std::to_string(options_.ft_replica_size));
  }
  workers_environment_ = std::move(shared);

  for (int local_rank = 0; local_rank < options_.nproc_per_node; ++local_rank) {
    Worker worker;
    worker.local_rank = local_rank;
    worker.global_rank = assignment_.base_rank + local_rank;
    if (options_.fault_tolerance) worker.replica_id = replica_id_for(local_rank, 0);
    workers_.push_back(std::move(worker));
  }
  // Every log file exists before the first worker starts, so a log directory we cannot write
  // stops the attempt before any work is done.
  if (!options_.log_dir.empty()) open_log_files();
  if (!setup_.stream_log_dir.empty()) open_stream_files();
  for (Worker& worker : workers_) {
    // With --log-dir, open_log_files() cleared it, checking what was there.
    worker.error_file = error_file_for(worker);
    if (options_.log_dir.empty()) ::unlink(worker.error_file.c_str());
    set_progress_file(worker);
    spawn(worker, environment_for(worker));
  }
}

// --fault-tolerance: next to the worker's error file, "<...>.trained"; an earlier run's goes
// (unlink removes a planted link, never what it points to).
void Job::set_progress_file(Worker& worker) const {
  if (!options_.fault_tolerance) return;
  const std::string suffix = ".error.json";
  worker.progress_file = worker.error_file.substr(0, worker.error_file.size() - suffix.size()) + ".trained";
  ::unlink(worker.progress_file.c_str());
}

Environment Job::environment_for(const Worker& worker) const {
  Environment environment = workers_environment_;
  if (setup_.omp_threads_from_cpus) {
    environment.set("OMP_NUM_THREADS", std::to_string(cpus_of(worker).size()));
  }
  environment.set(ddp::launch_env::kRank, std::to_string(worker.global_rank));
  environment.set(ddp::launch_env::kLocalRank, std::to_string(worker.local_rank));
  if (options_.virtual_local_rank) {
    // As torchrun: each worker sees only its own GPU, as device 0.
    environment.set(ddp::launch_env::kLocalRank, "0");
    environment.set("CUDA_VISIBLE_DEVICES", virtual_local_rank_device(worker.local_rank));
  }
  environment.set("ROLE_RANK", std::to_string(worker.global_rank));
  // Where the worker records its first error (torchrun's convention), so that the summary
  // names the earliest original error rather than whichever worker exited first.
  environment.set(ddp::launch_env::kErrorFile, worker.error_file);
  // ddp writes its collective traces here (trace_rank<R>.jsonl) when a
  // collective fails, next to the attempt's logs.
  if (!options_.log_dir.empty()) environment.set(ddp::launch_env::kLogDir, attempt_log_dir(options_.log_dir, attempt_));
  if (options_.fault_tolerance) {
    environment.set("DDP_FT_REPLICA_ID", worker.replica_id);
    environment.set("DDP_FT_PROGRESS_FILE", worker.progress_file);
  }
  return environment;
}

int Job::group_first_local_rank(int local_rank) const {
  return local_rank / options_.ft_replica_size * options_.ft_replica_size;
}

// The members of a replica group share their id: the group's first local rank names it, so that
// with groups of one it is each worker's own.
std::string Job::replica_id_for(int local_rank, int incarnation) const {
  return assignment_.ft_node_id + "/" + std::to_string(group_first_local_rank(local_rank)) + "/inc" +
         std::to_string(incarnation);
}

void Job::restart_as_next_incarnation(Worker& failed, int startup_exit_code) {
  Worker next;
  next.local_rank = failed.local_rank;
  next.global_rank = failed.global_rank;
  next.incarnation = failed.incarnation + 1;
  next.replica_id = replica_id_for(next.local_rank, next.incarnation);
  next.previous_startup_exit_code = startup_exit_code;
  // The same files as the first incarnation, appended to: one log per rank tells its story. They
  // move to the new incarnation rather than being copied, so that restarts hold no more
  // descriptors than the first start did. The old one's streams, if something of its group still
  // writes, go on writing to the same descriptors.
  next.log_file = std::move(failed.log_file);
  next.log_path = failed.log_path;
  next.stdout_file = std::move(failed.stdout_file);
  next.stdout_path = failed.stdout_path;
  next.stderr_file = std::move(failed.stderr_file);
  next.stderr_path = failed.stderr_path;
  next.error_file = error_file_for(next);
  ::unlink(next.error_file.c_str());
  set_progress_file(next);
  Worker& worker = workers_.emplace_back(std::move(next));
  spawn(worker, environment_for(worker));
}

std::string Job::error_file_for(const Worker& worker) const {
  // A restarted incarnation's own file: the earlier one's record stays for the summary.
  const std::string incarnation = worker.incarnation > 0 ? ".inc" + std::to_string(worker.incarnation) : "";
  if (!options_.log_dir.empty()) {
    return attempt_log_dir(options_.log_dir, attempt_) + "/rank_" + std::to_string(worker.global_rank) +
           incarnation + ".error.json";
  }
  return error_dir_ + "/attempt_" + std::to_string(attempt_) + ".rank_" + std::to_string(worker.global_rank) +
         incarnation + ".error.json";
}

void Job::open_log_files() {
  const std::string directory = attempt_log_dir(options_.log_dir, attempt_);
  const FileDescriptor root = open_directory(options_.log_dir);
  const std::string attempt_name = "attempt_" + std::to_string(attempt_);
  const FileDescriptor attempt_dir = open_own_subdirectory(root.get(), attempt_name, directory);
  for (Worker& worker : workers_) {
    const std::string rank = "rank_" + std::to_string(worker.global_rank);
    worker.log_path = directory + "/" + rank + ".log";
    worker.log_file = create_log_file(attempt_dir.get(), rank + ".log", worker.log_path);
    remove_stale_error_file(attempt_dir.get(), rank + ".error.json", directory + "/" + rank + ".error.json");
  }
}

// torchrun's layout: <stream_log_dir>/attempt_<A>/<local_rank>/{stdout,stderr}.log for the
// streams --redirects or --tee name, and attempt_<A>/filtered_{stdout,stderr}.log for the
// --duplicate-*-filters. stream_log_dir is fresh from mkdtemp, but the same care is cheap.
void Job::open_stream_files() {
  const std::string attempt_path = setup_.stream_log_dir + "/attempt_" + std::to_string(attempt_);
  const FileDescriptor root = open_directory(setup_.stream_log_dir);
  const FileDescriptor attempt_dir =
      open_own_subdirectory(root.get(), "attempt_" + std::to_string(attempt_), attempt_path);
  for (Worker& worker : workers_) {
    const std::string name = std::to_string(worker.local_rank);
    const std::string directory = attempt_path + "/" + name;
    const FileDescriptor rank_dir = open_own_subdirectory(attempt_dir.get(), name, directory);
    const int streams = std_streams_for(options_.redirects, worker.local_rank) |
                        std_streams_for(options_.tee_spec, worker.local_rank);
    if ((streams & kStdOut) != 0) {
      worker.stdout_path = directory + "/stdout.log";
      worker.stdout_file = create_log_file(rank_dir.get(), "stdout.log", worker.stdout_path);
    }
    if ((streams & kStdErr) != 0) {
      worker.stderr_path = directory + "/stderr.log";
      worker.stderr_file = create_log_file(rank_dir.get(), "stderr.log", worker.stderr_path);
    }
  }
  if (!options_.duplicate_stdout_filters.empty()) {
    filtered_stdout_path_ = attempt_path + "/filtered_stdout.log";
    filtered_stdout_ = create_log_file(attempt_dir.get(), "filtered_stdout.log", filtered_stdout_path_);
  }
  if (!options_.duplicate_stderr_filters.empty()) {
    filtered_stderr_path_ = attempt_path + "/filtered_stderr.log";
    filtered_stderr_ = create_log_file(attempt_dir.get(), "filtered_stderr.log", filtered_stderr_path_);
  }
}

const CpuList& Job::cpus_of(const Worker& worker) const {
  static const CpuList kUnbound;
  const size_t index = static_cast<size_t>(worker.local_rank);
  return index < setup_.cpus_by_local_rank.size() ? setup_.cpus_by_local_rank[index] : kUnbound;
}

// Where the lines of one of the worker's streams (kStdOut or kStdErr) go, as torchrun sends
// them: a redirected stream only to its file, a teed one to its file and to the console with
// torchrun's "[<role><local_rank>]:" (and, matching a --duplicate-*-filter, to the filtered
// file), any other to the console with ddprun's "[rank<R>]: " (which --no-prefix drops, so
// that the console reads as torchrun's). --local-ranks-filter keeps the other ranks off the
// console (and out of the filtered file, as torchrun does). With --log-dir, ddprun's
// rank_<R>.log gets both streams whatever the rest says.
std::vector<LineSink> Job::sinks_for(const Worker& worker, int console_fd, int stream) const {
  const bool redirected = (std_streams_for(options_.redirects, worker.local_rank) & stream) != 0;
  const bool teed = (std_streams_for(options_.tee_spec, worker.local_rank) & stream) != 0;
  const bool shown = setup_.console_local_ranks.empty() || setup_.console_local_ranks.count(worker.local_rank) != 0;
  const std::string torchrun_prefix = "[" + options_.role + std::to_string(worker.local_rank) + "]:";
  std::vector<LineSink> sinks;
  if (worker.log_file.get() >= 0) {
    sinks.push_back(LineSink{worker.log_file.get(), "", /*console=*/false, {}, worker.log_path});
  }
  const FileDescriptor& stream_file = stream == kStdOut ? worker.stdout_file : worker.stderr_file;
  if (stream_file.get() >= 0) {
    sinks.push_back(LineSink{stream_file.get(), "", /*console=*/false, {},
                             stream == kStdOut ? worker.stdout_path : worker.stderr_path});
  }
  if (!shown) return sinks;
  if (teed) {
    sinks.push_back(LineSink{console_fd, torchrun_prefix, /*console=*/true, {}, ""});
    const FileDescriptor& filtered = stream == kStdOut ? filtered_stdout_ : filtered_stderr_;
    const auto& filters = stream == kStdOut ? options_.duplicate_stdout_filters : options_.duplicate_stderr_filters;
    const std::string& filtered_path = stream == kStdOut ? filtered_stdout_path_ : filtered_stderr_path_;
    if (filtered.get() >= 0) {
      sinks.push_back(LineSink{filtered.get(), torchrun_prefix, /*console=*/false, filters, filtered_path});
    }
  } else if (!redirected) {
    const std::string prefix = options_.prefix_output ? "[rank" + std::to_string(worker.global_rank) + "]: " : "";
    sinks.push_back(LineSink{console_fd, prefix, /*console=*/true, {}, ""});
  }
  return sinks;
}

void Job::spawn(Worker& worker, const Environment& environment) {
  // Everything the child needs is built before fork, so the child only makes system calls.
  std::vector<char*> argv = c_string_array(options_.command);
  std::vector<char*> envp = c_string_array(environment.entries());
  const std::string exec_failure = "ddprun: cannot execute '" + options_.command[0] + "': ";
  std::vector<LineSink> out_sinks = sinks_for(worker, STDOUT_FILENO, kStdOut);
  std::vector<LineSink> err_sinks = sinks_for(worker, STDERR_FILENO, kStdErr);
  const CpuList& cpus = cpus_of(worker);
  cpu_set_t cpu_set;
  CPU_ZERO(&cpu_set);
  for (int cpu : cpus) CPU_SET(cpu, &cpu_set);
  const std::string bind_failure = "ddprun: cannot bind local rank " + std::to_string(worker.local_rank) +
                                   " to CPUs " + format_cpu_list(cpus) + ": ";

  int out_pipe[2];
  int err_pipe[2];
  if (::pipe2(out_pipe, O_CLOEXEC) != 0) throw_errno("pipe2");
  if (::pipe2(err_pipe, O_CLOEXEC) != 0) {
    int saved = errno;
    ::close(out_pipe[0]);
    ::close(out_pipe[1]);
    errno = saved;
    throw_errno("pipe2");
  }

  // Own process group (fork_supervised_child's), so that stopping a worker also reaches the
  // processes it started; it dies with the launcher. ensure_standard_fds_open() guarantees the
  // pipe ends are not 1 or 2 themselves.
  const pid_t pid = fork_supervised_child(out_pipe[1], [&] {
    signals_.reset_in_child();
    ::signal(SIGPIPE, SIG_DFL);
    ::dup2(err_pipe[1], STDERR_FILENO);
    // Before exec, so that every thread the program starts inherits it.
    if (!cpus.empty() && ::sched_setaffinity(0, sizeof cpu_set, &cpu_set) != 0) {
      const char* reason = std::strerror(errno);
      write_all(STDERR_FILENO, bind_failure.data(), bind_failure.size());
      write_all(STDERR_FILENO, reason, std::strlen(reason));
      write_all(STDERR_FILENO, "\n", 1);
      ::_exit(127);
    }
    sigset_t no_signals;
    sigemptyset(&no_signals);
    ::sigprocmask(SIG_SETMASK, &no_signals, nullptr);
    ::execvpe(argv[0], argv.data(), envp.data());
    const char* reason = std::strerror(errno);
    write_all(STDERR_FILENO, exec_failure.data(), exec_failure.size());
    write_all(STDERR_FILENO, reason, std::strlen(reason));
    write_all(STDERR_FILENO, "\n", 1);
    ::_exit(127);
  });
  const int fork_errno = errno;
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  if (pid < 0) {
    ::close(out_pipe[0]);
    ::close(err_pipe[0]);
    errno = fork_errno;
    throw_errno("fork");
  }
  // Also done here so the group exists before we could signal it, whoever runs first.
  ::setpgid(pid, pid);
  worker.pid = pid;
  watchdog_.watch(pid);

  worker.streams.emplace_back(out_pipe[0], std::move(out_sinks));
  worker.streams.emplace_back(err_pipe[0], std::move(err_sinks));
  if (options_.fault_tolerance) {
    // ddp's fault-tolerance layer prints this once the worker is a member of a generation (a
    // joiner's admission, or any change of membership it lived through): it got past start-up.
    for (LineForwarder& stream : worker.streams) stream.watch_for("ddp: membership: ");
  }
}

}  // namespace ddprun
