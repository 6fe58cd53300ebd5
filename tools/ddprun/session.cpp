#include "session.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <sstream>
#include <vector>

#include "console.h"
#include "cpu_binding.h"
#include "etcd_rendezvous.h"
#include "job.h"
#include "posix_util.h"
#include "rdzv.h"
#include "signal_pipe.h"
#include "std_spec.h"
#include "store_keeper.h"
#include "watchdog.h"

#include <ddp/launch_env.h>

namespace ddprun {
namespace {

// What ddprun catches: SIGCHLD to watch its workers, SIGUSR1 to pass on for stack dumps, and
// the --signals-to-handle that stop the job.
std::vector<int> caught_signals(const LaunchOptions& options) {
  std::vector<int> signals = {SIGCHLD, SIGUSR1};
  for (int signal_number : options.handled_signals) {
    if (std::find(signals.begin(), signals.end(), signal_number) == signals.end()) signals.push_back(signal_number);
  }
  return signals;
}

// Whether a server could listen on 127.0.0.1:port now. SO_REUSEADDR like c10d's TCPStore, so
// the previous attempt's connections lingering in TIME_WAIT do not count as a user of the port.
bool loopback_port_is_free(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0;
  ::close(fd);
  return bound;
}

// This node's place in the job for one round, whether the static flags fixed it or the
// rendezvous store formed the round.
Assignment assignment_for(const RdzvView& round) {
  Assignment assignment;
  assignment.attempt = round.round;
  assignment.restart_count = round.restart_count;
  assignment.node_rank = round.node_rank;
  assignment.nnodes = round.nnodes;
  assignment.world_size = round.world_size;
  assignment.base_rank = round.base_rank;
  assignment.master_addr = round.master_addr;
  assignment.master_port = round.master_port;
  return assignment;
}

// --fault-tolerance: this ddprun's part of its workers' replica ids, "node<R>-<8 hex digits>":
// random, so that a node whose ddprun is started again never hands out an id twice.
std::string ft_node_id(int node_rank) {
  unsigned char bytes[4] = {};
  FileDescriptor source(::open("/dev/urandom", O_RDONLY | O_CLOEXEC));
  if (source.get() < 0 || ::read(source.get(), bytes, sizeof bytes) != static_cast<ssize_t>(sizeof bytes)) {
    throw_errno("cannot read /dev/urandom for the workers' replica ids");
  }
  static const char kHex[] = "0123456789abcdef";
  std::string id = "node" + std::to_string(node_rank) + "-";
  for (unsigned char byte : bytes) {
    id += kHex[byte >> 4];
    id += kHex[byte & 0xf];
  }
  return id;
}

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0 || name[0] == '\0') return "(unknown host)";
  return name;
}

// The whole run: the attempts, and what lives across them.
class Session {
 public:
  explicit Session(const LaunchOptions& options)
      : options_(options), signals_(caught_signals(options)) {
    if (options_.log_dir.empty()) error_dir_ = make_error_dir();
  }
  ~Session() { remove_error_dir(); }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  int run() {
    setup_ = worker_setup();
    if (options_.rdzv_backend == "c10d") return run_rendezvous();
    if (options_.rdzv_backend == "etcd-v2") return run_etcd_rendezvous();
    Environment shared = shared_environment();
    if (options_.fault_tolerance) {
      // Node 0's ddprun keeps the store; the others reach it at the master's address.
      const std::string host = options_.standalone ? "127.0.0.1" : options_.master_addr;
      int port = options_.ft_store_port;
      if (port == 0 && !options_.standalone) port = options_.master_port + 1;
      if (options_.standalone || options_.node_rank == 0) port = start_store_keeper(port);
      shared.set("DDP_FT_STORE", "tcp://" + host + ":" + std::to_string(port));
    }
    // Static: the flags fix this node's place; only the attempt and the port change.
    RdzvView place;
    place.node_rank = options_.node_rank;
    place.nnodes = options_.nnodes;
    place.world_size = options_.nnodes * options_.nproc_per_node;
    place.base_rank = options_.node_rank * options_.nproc_per_node;
    place.master_addr = options_.standalone ? "127.0.0.1" : options_.master_addr;
    place.master_port = options_.standalone ? pick_free_port() : options_.master_port;
    int& master_port = place.master_port;

    for (int attempt = 0;; ++attempt) {
      place.round = attempt;
      place.restart_count = attempt;
      Assignment assignment = assignment_for(place);
      if (options_.fault_tolerance) assignment.ft_node_id = ft_node_id(place.node_rank);
      AttemptOutcome outcome = Job(options_, assignment, shared, setup_, error_dir_, watchdog_, signals_).run();
      if (outcome.received_signal != 0) return finish(128 + outcome.received_signal);
      if (!outcome.worker_failed) return finish(0);
      // Under --fault-tolerance the restarts were each worker's own: every worker failed for good.
      if (attempt >= options_.max_restarts || options_.fault_tolerance) {
        // A start-up failure was named in one line already.
        if (!outcome.startup_failure) report_root_cause(attempt, outcome.first_failure);
        return finish(1);
      }
      // A stop request that arrived once the attempt was over still rules out a restart.
      if (const int stop_signal = pending_stop_signal()) {
        say("received " + signal_name(stop_signal) + "; not restarting the workers");
        return finish(128 + stop_signal);
      }
      const FailedWorker& failure = outcome.first_failure;
      say("rank " + std::to_string(failure.global_rank) + " failed (" +
          failure.exit_text + "); restarting all workers (restart " + std::to_string(attempt + 1) + " of " +
          std::to_string(options_.max_restarts) + ")");
      if (options_.standalone && !loopback_port_is_free(master_port)) {
        const int previous_port = master_port;
        master_port = pick_free_port();
        say("port " + std::to_string(previous_port) +
            " on 127.0.0.1 is taken now; the restarted workers use port " +
            std::to_string(master_port));
      }
    }
  }

 private:
  // The whole run with the c10d rendezvous: every round's place in the job comes from the
  // agents' store, which one of the agents hosts.
  int run_rendezvous() {
    Environment shared = shared_environment();
    std::string host = options_.rdzv_endpoint;
    int port = 29400;
    const size_t colon = host.rfind(':');
    if (colon != std::string::npos) {
      port = std::atoi(host.c_str() + colon + 1);
      host = host.substr(0, colon);
    }
    RdzvConfig config;
    config.run_id = options_.run_id;
    config.min_nodes = options_.min_nodes;
    config.max_nodes = options_.nnodes;
    config.max_restarts = options_.max_restarts;
    config.join_timeout = options_.join_timeout_seconds;
    config.last_call_timeout = options_.last_call_timeout_seconds;
    config.heartbeat_timeout = options_.heartbeat_timeout_seconds;
    std::string secret_file = options_.rdzv_secret_file;
    if (secret_file.empty() && std::getenv("DDP_RDZV_SECRET_FILE") != nullptr) secret_file = std::getenv("DDP_RDZV_SECRET_FILE");
    if (!secret_file.empty()) config.secret = load_rdzv_secret(secret_file);
    std::string why;
    int error_number = 0;
    // The agent on the endpoint's host hosts the store (the first one there to bind it); the
    // store listens on that address only. It lives as long as this ddprun.
    std::unique_ptr<RdzvServer> server = RdzvServer::try_bind(host, port, config, &why, &error_number);
    if (server) {
      say("hosting the rendezvous store on " + host + ":" + std::to_string(port) + " (run id '" + options_.run_id +
          "', " + std::to_string(options_.min_nodes) + ".." + std::to_string(options_.nnodes) + " nodes)");
      if (config.secret.empty()) {
        say("warning: the rendezvous store has no secret: anyone who can reach " + host + ":" + std::to_string(port) +
            " can join this job or end it, as with torchrun's; give every node the same --rdzv-secret-file "
            "(docs/security.md)");
      }
    } else if (error_number != EADDRINUSE && error_number != EADDRNOTAVAIL) {
      say("cannot host the rendezvous store on " + host + ":" + std::to_string(port) + " (" + why +
          "); joining it as a client");
    }
    if (options_.fault_tolerance) {
      // The ddprun hosting the rendezvous keeps the workers' store too, on the next port.
      int ft_port = options_.ft_store_port != 0 ? options_.ft_store_port : port + 1;
      if (server) ft_port = start_store_keeper(ft_port);
      shared.set("DDP_FT_STORE", "tcp://" + host + ":" + std::to_string(ft_port));
    }
    if (options_.node_rank_given) say("--node-rank is ignored with --rdzv-backend c10d: the rendezvous assigns node ranks");
    RdzvClient client(host, port, options_.local_addr, options_.monitor_interval_seconds,
                      options_.heartbeat_timeout_seconds, config.secret);
    client.join(options_.run_id, host_name(), options_.nproc_per_node, server != nullptr,
                options_.join_timeout_seconds);
    client.start_heartbeat();
    auto end_job = [&](int code) {
      // The others may still be polling for the outcome: the store goes when they know it.
      if (server) server->wait_until_everyone_knows(options_.heartbeat_timeout_seconds + 1);
      return finish(code);
    };

    int last_round = -1;
    while (true) {
      RdzvView view;
      if (const int stop_signal = wait_for_round(client, last_round, &view)) {
        say("received " + signal_name(stop_signal) + "; leaving the job");
        client.leave();
        return finish(128 + stop_signal);
      }
      if (view.kind == RdzvView::kDone) return end_job(0);
      if (view.kind == RdzvView::kFail) {
        std::string block;
        std::stringstream lines(view.text);
        for (std::string line; std::getline(lines, line);) block += "ddprun: " + printable(line) + "\n";
        console_write(STDERR_FILENO, block, /*own=*/true);
        return end_job(1);
      }
      if (view.kind != RdzvView::kRound) {
        say(view.text);
        return finish(1);
      }
      Assignment assignment = assignment_for(view);
      if (options_.fault_tolerance) assignment.ft_node_id = ft_node_id(view.node_rank);
      say("rendezvous round " + std::to_string(view.round) + " (" + view.text + "): node rank " +
          std::to_string(view.node_rank) + " of " + std::to_string(view.nnodes) + ", ranks " +
          std::to_string(view.base_rank) + ".." + std::to_string(view.base_rank + options_.nproc_per_node - 1) +
          " of world size " + std::to_string(view.world_size) + ", master " + view.master_addr + ":" +
          std::to_string(view.master_port));
      AttemptOutcome outcome =
          Job(options_, assignment, shared, setup_, error_dir_, watchdog_, signals_, &client).run();
      last_round = view.round;
      if (outcome.received_signal != 0) {
        client.report(view.round, "signal", {signal_name(outcome.received_signal)});
        return finish(128 + outcome.received_signal);
      }
      if (options_.fault_tolerance) {
        // One round: the workers rode out what happened; this node's outcome is its own.
        client.report(view.round, outcome.worker_failed ? "stopped" : "success", {});
        if (outcome.worker_failed && !outcome.startup_failure) report_root_cause(0, outcome.first_failure);
        return end_job(outcome.worker_failed ? 1 : 0);
      }
      if (outcome.store_lost) return finish(1);
      if (outcome.worker_failed) {
        const FailedWorker& f = outcome.first_failure;
        const bool recorded = f.record.present;
        client.report(view.round, "failed",
                      {std::to_string(f.global_rank), std::to_string(f.local_rank), std::to_string(f.pid),
                       f.exit_text, f.last_line,
                       f.log_write_error.empty() ? f.log_path : f.log_path + " (incomplete: writing " + f.log_write_error + ")",
                       recorded ? "1" : "0",
                       recorded ? f.record.message : "", recorded && f.record.consequence ? "1" : "0",
                       std::to_string(recorded ? f.record.timestamp_ns : 0), host_name()});
      } else {
        client.report(view.round, outcome.stopped_by_rendezvous ? "stopped" : "success", {});
      }
    }
  }

  // The whole run with the etcd-v2 rendezvous: one round, formed in the etcd cluster, which
  // no ddprun hosts.
  int run_etcd_rendezvous() {
    EtcdRendezvous rendezvous(options_);
    say("joining the etcd-v2 rendezvous at " + rendezvous.endpoints() + " (run id '" + options_.run_id + "', " +
        std::to_string(options_.min_nodes) + ".." + std::to_string(options_.nnodes) + " nodes)");
    if (options_.node_rank_given) say("--node-rank is ignored with --rdzv-backend etcd-v2: the rendezvous assigns node ranks");
    RoundAssignment round;
    if (const int stop_signal = rendezvous.join(signals_, &round)) {
      say("received " + signal_name(stop_signal) + "; leaving the job");
      return finish(128 + stop_signal);
    }
    Environment shared = shared_environment();
    if (options_.fault_tolerance) shared.set("DDP_FT_STORE", rendezvous.ft_store_spec());
    RdzvView place;
    place.round = 0;
    place.restart_count = 0;
    static_cast<RoundAssignment&>(place) = round;
    Assignment assignment = assignment_for(place);
    if (options_.fault_tolerance) assignment.ft_node_id = ft_node_id(round.node_rank);
    if (rendezvous.late()) {
      say("etcd-v2 rendezvous: the round formed with " + std::to_string(round.nnodes) +
          " node(s) before this one; joining the running job as node " + std::to_string(round.node_rank) +
          " (--fault-tolerance): its workers join the replicas and heal from a live one");
    }
    say("etcd-v2 rendezvous: node rank " + std::to_string(round.node_rank) + " of " + std::to_string(round.nnodes) +
        ", ranks " + std::to_string(round.base_rank) + ".." +
        std::to_string(round.base_rank + options_.nproc_per_node - 1) + " of world size " +
        std::to_string(round.world_size) + ", master " + round.master_addr + ":" + std::to_string(round.master_port));
    rendezvous.start_watching();
    Job job(options_, assignment, shared, setup_, error_dir_, watchdog_, signals_);
    job.set_etcd_rendezvous(&rendezvous);
    const AttemptOutcome outcome = job.run();
    if (outcome.received_signal != 0) {
      rendezvous.report_done("signal");
      return finish(128 + outcome.received_signal);
    }
    if (outcome.worker_failed) {
      if (!outcome.startup_failure) report_root_cause(0, outcome.first_failure);
      rendezvous.report_done("failed");
      return finish(1);
    }
    if (outcome.stopped_by_rendezvous) {
      rendezvous.report_done("stopped");
      return finish(1);
    }
    rendezvous.report_done("success");
    return finish(0);
  }

  // Waits for this node's next round (or the job's end). Returns a stop signal if ddprun was
  // asked to stop meanwhile, else 0 with *view set.
  int wait_for_round(RdzvClient& client, int& last_round, RdzvView* view) {
    std::string last_wait_text;
    while (true) {
      client.mark_supervisor_alive();
      for (int signal_number : signals_.drain()) {
        if (signal_number != SIGCHLD && signal_number != SIGUSR1) return signal_number;
      }
      *view = client.view();
      if (view->kind == RdzvView::kRound && view->round > last_round) return 0;
      if (view->kind == RdzvView::kStop && view->round > last_round) {
        // A round that formed and was stopped before we saw it: we are in it, so we end it.
        say("rendezvous round " + std::to_string(view->round) +
            " was stopped before this node started its workers: " + view->text);
        client.report(view->round, "stopped", {});
        last_round = view->round;
        continue;
      }
      if (view->kind == RdzvView::kDone || view->kind == RdzvView::kFail || view->kind == RdzvView::kLost) return 0;
      if (client.store_lost()) {
        view->kind = RdzvView::kLost;
        view->text = "lost the rendezvous store at " + client.endpoint() + ": no answer for " +
                     format_seconds(std::round(client.seconds_since_answer() * 10) / 10) +
                     " s (the ddprun hosting it is gone, or the network is cut)";
        return 0;
      }
      if (view->kind == RdzvView::kWait && view->text != last_wait_text && last_round < 0) {
        last_wait_text = view->text;
        say("waiting for the rendezvous at " + client.endpoint() + ": " + view->text);
      }
      std::vector<pollfd> fds = {{signals_.read_fd(), POLLIN, 0}, {client.wake_fd(), POLLIN, 0}};
      console_add_poll_fds(fds);
      if (::poll(fds.data(), fds.size(), 200) > 0 && fds[1].revents != 0) client.drain_wake();
      console_flush();
    }
  }

  // --fault-tolerance: starts ddp_ft_store on `port` (0: any) for the workers' store and
  // returns the port it serves on. It lives as long as this session.
  int start_store_keeper(int port) {
    store_keeper_ = StoreKeeper::start(port, signals_);
    say("fault tolerance: serving the workers' store on port " + std::to_string(store_keeper_->port()) +
        " (ddp_ft_store, pid " + std::to_string(store_keeper_->pid()) +
        "); this node is the job's single point of failure, which --rdzv-backend etcd-v2 removes");
    return store_keeper_->port();
  }

  // The environment every worker of every attempt shares.
  Environment shared_environment() const {
    Environment environment = Environment::inherited();
    if (options_.fault_tolerance) {
      environment.set("DDP_FAULT_TOLERANCE", "1");
      environment.set("DDP_FT_DEADLINE_MS", std::to_string(std::llround(options_.ft_deadline_seconds * 1000)));
    }
    environment.set(ddp::launch_env::kLocalWorldSize, std::to_string(options_.nproc_per_node));
    environment.set("ROLE_NAME", options_.role);
    environment.set("TORCHELASTIC_MAX_RESTARTS", std::to_string(options_.max_restarts));
    environment.set("TORCHELASTIC_SIGNALS_TO_HANDLE", options_.signals_to_handle);
    // Rank 0 of the workers hosts their store (ddp's ProcessGroup, torch's env://); ddprun hosts
    // none, unlike torchrun's agent, so a worker must not wait for one.
    environment.set(ddp::launch_env::kUseAgentStore, "False");
    if (std::getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING") == nullptr) {
      environment.set("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1");
    }
    // ddp installs its SIGUSR1 stack dump and std::terminate handler only when asked: under
    // ddprun the workers are, so that SIGUSR1 to ddprun dumps every worker's stacks. The user's
    // own value (0 for a program that handles SIGUSR1 itself) passes through.
    if (std::getenv(ddp::launch_env::kDiagnosticHandlers) == nullptr) {
      environment.set(ddp::launch_env::kDiagnosticHandlers, "1");
    }
    environment.set(ddp::launch_env::kRunId, options_.run_id);
    environment.set(ddp::launch_env::kDdpRunId, options_.run_id);
    if (setup_.omp_threads_from_cpus) {
      say("OMP_NUM_THREADS is not set; with --cpu-bind cores, setting it for each of the " +
          std::to_string(options_.nproc_per_node) +
          " workers to the number of CPUs it is bound to, so they use their own CPUs and no others; "
          "please further tune it for your application as needed");
    } else if (std::getenv("OMP_NUM_THREADS") == nullptr && options_.nproc_per_node > 1) {
      // Each worker's OpenMP pool would otherwise take every core, oversubscribing the node.
      environment.set("OMP_NUM_THREADS", "1");
      say("OMP_NUM_THREADS is not set; setting it to 1 for each of the " +
          std::to_string(options_.nproc_per_node) +
          " workers by default, as torchrun does, to avoid your system being overloaded; please further "
          "tune it for your application as needed");
    }
    return environment;
  }

  // Once per run: where the streams' files go, which ranks the console shows, and the CPUs.
  WorkerSetup worker_setup() const {
    WorkerSetup setup;
    setup.console_local_ranks = parse_local_ranks(options_.local_ranks_filter);
    const CpuBindingPlan binding =
        plan_cpu_binding(options_.numa_binding, options_.cpu_bind, options_.nproc_per_node);
    for (const std::string& note : binding.notes) say(note);
    setup.cpus_by_local_rank = binding.by_local_rank;
    setup.omp_threads_from_cpus = options_.cpu_bind == "cores" && std::getenv("OMP_NUM_THREADS") == nullptr;
    const bool some_stream_to_file = options_.redirects != "0" || options_.tee_spec != "0";
    if (options_.log_dir.empty() && !some_stream_to_file) return setup;
    // As torchrun: without --log-dir, the streams' files go to a fresh temporary directory.
    std::string root = options_.log_dir;
    if (root.empty()) root = make_temp_dir("torchelastic_");
    // A run id is any text; as a file name's prefix, a '/' in it must not lead out of the root.
    std::string prefix = options_.run_id + "_";
    std::replace(prefix.begin(), prefix.end(), '/', '_');
    setup.stream_log_dir = make_temp_dir(prefix, root);
    if (options_.log_dir.empty()) {
      say("redirected and teed output goes to " + setup.stream_log_dir + "/attempt_<A>/<local rank>/");
    }
    return setup;
  }

  // mkdtemp of <parent>/<prefix>XXXXXX; parent defaults to $TMPDIR or /tmp. `what` names the
  // directory in the error.
  static std::string make_temp_dir(const std::string& prefix, std::string parent = "",
                                   const std::string& what = "") {
    if (parent.empty()) {
      const char* tmp = std::getenv("TMPDIR");
      parent = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
    }
    std::string pattern = parent + "/" + prefix + "XXXXXX";
    std::vector<char> buffer(pattern.begin(), pattern.end());
    buffer.push_back('\0');
    if (::mkdtemp(buffer.data()) == nullptr) {
      throw_errno(what.empty() ? "cannot create log directory '" + pattern + "'" : "cannot create " + what);
    }
    return buffer.data();
  }

  // SIGINT, SIGTERM or SIGHUP delivered since the last attempt looked; 0 if none.
  int pending_stop_signal() {
    int stop_signal = 0;
    for (int signal_number : signals_.drain()) {
      if (signal_number != SIGCHLD && signal_number != SIGUSR1 && stop_signal == 0) stop_signal = signal_number;
    }
    return stop_signal;
  }

  void report_root_cause(int restarts_used, const FailedWorker& failure) const {
    std::string heading = "root cause (first failure of the last attempt):";
    std::string detail = "  last error line: " + failure.last_line;
    if (failure.record.present && !failure.record.consequence) {
      heading = "root cause (the earliest original error of the last attempt):";
      detail = "  error: " + failure.record.message;
    } else if (failure.record.present) {
      heading =
          "root cause (the earliest error of the last attempt; every recorded error is a "
          "consequence of another failure, such as a worker that died without a message):";
      detail = "  error (a consequence): " + failure.record.message;
    }
    std::vector<std::string> lines = {
        "job failed after " + std::to_string(restarts_used) + " restart(s)",
        heading,
        "  rank: " + std::to_string(failure.global_rank) + " (local rank " +
            std::to_string(failure.local_rank) + "), host: " + host_name() +
            ", pid: " + std::to_string(failure.pid),
        "  exit: " + failure.exit_text,
        detail,
    };
    if (!failure.log_write_error.empty()) {
      // The log holds less than the console showed: quote what it misses.
      if (!failure.log_path.empty()) lines.push_back("  log: " + failure.log_path + " (incomplete)");
      lines.push_back("  its log ends early, since ddprun could not write " + failure.log_write_error +
                      "; its last lines were:");
      for (const std::string& line : failure.recent_lines) lines.push_back("    " + line);
    } else if (!failure.log_path.empty()) {
      lines.push_back("  log: " + failure.log_path);
    }
    std::string block;
    for (const std::string& line : lines) block += "ddprun: " + printable(line) + "\n";
    console_write(STDERR_FILENO, block, /*own=*/true);  // queued whole: no worker line lands inside
  }

  int finish(int exit_code) {
    // Every worker was reaped and forgotten; the watchdog may go.
    watchdog_.dismiss();
    remove_error_dir();
    return exit_code;
  }

  // Without --log-dir, the workers' error files live in a private directory that goes with
  // the session.
  static std::string make_error_dir() {
    return make_temp_dir("ddprun-errors-", "", "a directory for the workers' error files");
  }

  void remove_error_dir() {
    if (error_dir_.empty()) return;
    std::error_code ignored;
    std::filesystem::remove_all(error_dir_, ignored);
    error_dir_.clear();
  }

  const LaunchOptions& options_;
  WorkerSetup setup_;
  std::unique_ptr<StoreKeeper> store_keeper_;  // --fault-tolerance on the node hosting the store
  // Forked first, before any handler or worker pipe exists that it should not inherit.
  Watchdog watchdog_;
  SignalPipe signals_;
  std::string error_dir_;  // without --log-dir: the workers' error files
};

}  // namespace

int run_session(const LaunchOptions& options) { return Session(options).run(); }

}  // namespace ddprun
