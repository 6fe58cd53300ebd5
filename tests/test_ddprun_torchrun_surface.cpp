// ddprun against torchrun 2.11's whole command line (issue 26): every flag in both spellings,
// PET_* defaults, --role, --signals-to-handle, --virtual-local-rank, and the environment a
// worker sees, compared variable by variable with what torchrun (python -m
// torch.distributed.run --no-python) gives the same worker for the same flags. The workers are
// /bin/sh scripts that dump `env`; every run is real processes under a timeout.

#include <gtest/gtest.h>
#include <support/launch.h>

#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

namespace fs = std::filesystem;
using namespace ddp::testing;

namespace {

using Env = std::map<std::string, std::string>;
// "RANK.RESTART_COUNT" -> the environment that worker saw.
using Dumps = std::map<std::string, Env>;

// What the launchers may read: none of it may leak in from the environment running the tests.
const std::vector<std::string> kLauncherVariables = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "DDP_RUN_ID", "DDP_RDZV_SECRET_FILE", "DDP_DIAGNOSTIC_HANDLERS", "PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR",
    "PET_MASTER_PORT", "PET_STANDALONE", "PET_RDZV_BACKEND", "PET_RDZV_ENDPOINT", "PET_RDZV_ID", "PET_ROLE",
    "PET_MAX_RESTARTS", "PET_SIGNALS_TO_HANDLE", "PET_VIRTUAL_LOCAL_RANK", "PET_LOG_DIR", "PET_TEE",
    "PET_REDIRECTS", "PET_START_METHOD", "PET_MODULE", "PET_RUN_PATH", "PET_NO_PYTHON"};

RunOptions clean(std::vector<std::pair<std::string, std::string>> env, std::chrono::seconds timeout) {
  RunOptions options;
  // Python coerces a C locale to C.UTF-8 and exports it (PEP 538); set here, neither adds it.
  env.emplace_back("LC_CTYPE", "C.UTF-8");
  for (const std::string& name : kLauncherVariables) {
    bool given = false;
    for (const auto& [key, value] : env) given = given || key == name;
    if (!given) options.unset_env.push_back(name);
  }
  options.env = std::move(env);
  options.timeout = timeout;
  return options;
}

bool torchrun_available() {
  static const bool available =
      run_process({DDP_PYTHON, "-c", "import torch.distributed.run"}, clean({}, std::chrono::seconds(60))).exit_code ==
      0;
  return available;
}

// A worker that writes its environment to DIR/env.<RANK>.<RESTART_COUNT>, then runs `then`.
std::vector<std::string> dump_worker(const std::string& dir, const std::string& then = "") {
  const std::string script =
      "f=\"$0/env.$RANK.$TORCHELASTIC_RESTART_COUNT\"; env > \"$f.part\" && mv \"$f.part\" \"$f\"; " + then;
  return {"/bin/sh", "-c", script, dir};
}

enum class Launcher { kTorchrun, kDdprun };

std::vector<std::string> command(Launcher launcher, const std::vector<std::string>& flags,
                                 const std::vector<std::string>& worker) {
  std::vector<std::string> argv;
  if (launcher == Launcher::kTorchrun) {
    argv = {DDP_PYTHON, "-m", "torch.distributed.run"};
  } else {
    argv = {bin_path("ddprun")};
  }
  argv.insert(argv.end(), flags.begin(), flags.end());
  if (launcher == Launcher::kTorchrun) argv.push_back("--no-python");
  argv.insert(argv.end(), worker.begin(), worker.end());
  return argv;
}

// One agent (one "node") of a job: its flags and the environment it starts in.
struct Agent {
  std::vector<std::string> flags;
  std::vector<std::pair<std::string, std::string>> env;
};

Dumps read_dumps(const std::string& dir) {
  Dumps dumps;
  const std::regex name(R"(env\.(\d+\.\d+))");
  const std::regex line(R"(([A-Za-z_][A-Za-z0-9_]*)=(.*))");
  for (const auto& entry : fs::directory_iterator(dir)) {
    std::smatch match;
    const std::string file = entry.path().filename().string();
    if (!std::regex_match(file, match, name)) continue;
    Env& env = dumps[match[1]];
    std::ifstream in(entry.path());
    for (std::string text; std::getline(in, text);) {
      std::smatch kv;
      if (std::regex_match(text, kv, line)) env[kv[1]] = kv[2];
    }
  }
  return dumps;
}

// Runs every agent at once in working directory `cwd` and returns what the workers saw.
Dumps run_job(Launcher launcher, const std::vector<Agent>& agents, const std::string& cwd, const std::string& then) {
  const std::string dir = make_temp_dir(launcher == Launcher::kTorchrun ? "surface_torchrun" : "surface_ddprun");
  std::vector<BackgroundProcess> running;
  for (const Agent& agent : agents) {
    RunOptions options = clean(agent.env, std::chrono::seconds(120));
    options.cwd = cwd;
    running.push_back(start_background(command(launcher, agent.flags, dump_worker(dir, then)), options));
  }
  for (size_t n = 0; n < running.size(); ++n) {
    ProcessResult result = wait_background(running[n], std::chrono::seconds(120));
    EXPECT_EQ(result.exit_code, 0) << (launcher == Launcher::kTorchrun ? "torchrun" : "ddprun") << " agent " << n
                                   << ": " << result.describe();
  }
  Dumps dumps = read_dumps(dir);
  fs::remove_all(dir);
  return dumps;
}

bool is_port(const std::string& value) {
  return std::regex_match(value, std::regex("[1-9][0-9]{0,4}")) && std::stoi(value) <= 65535;
}
bool is_uuid(const std::string& value) {
  return std::regex_match(value, std::regex("[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"));
}

// Variables only ddprun sets (README, launcher section).
const std::set<std::string> kDdprunExtras = {"DDP_RUN_ID", "DDPRUN_ATTEMPT", "DDP_DIAGNOSTIC_HANDLERS"};

// One variable of one worker. Values that differ per run (ports, temporary paths, fresh ids)
// are compared by shape; the deliberate differences are the README's.
void expect_same_variable(const std::string& where, const std::string& key, const std::string& torchrun,
                          const std::string& ddprun) {
  SCOPED_TRACE(where + " " + key + ": torchrun '" + torchrun + "', ddprun '" + ddprun + "'");
  if (key == "MASTER_PORT") {
    EXPECT_TRUE(is_port(torchrun) && is_port(ddprun));
  } else if (key == "MASTER_ADDR") {
    // Deliberate: torchrun names the host ("localhost", its FQDN); ddprun gives an address, so
    // that no resolver picks ::1 or a wrong interface.
    EXPECT_FALSE(torchrun.empty());
    EXPECT_TRUE(std::regex_match(ddprun, std::regex(R"(\d+\.\d+\.\d+\.\d+)")) || ddprun == torchrun);
  } else if (key == "TORCHELASTIC_ERROR_FILE") {
    EXPECT_TRUE(torchrun.front() == '/' && torchrun.size() > 5 && torchrun.substr(torchrun.size() - 5) == ".json");
    EXPECT_TRUE(ddprun.front() == '/' && ddprun.size() > 5 && ddprun.substr(ddprun.size() - 5) == ".json");
  } else if (key == "TORCHELASTIC_RUN_ID" && is_uuid(torchrun)) {
    EXPECT_TRUE(is_uuid(ddprun));
  } else if (key == "TORCHELASTIC_USE_AGENT_STORE") {
    // Deliberate: torchrun's agent hosts the workers' store; ddprun's workers host their own.
    EXPECT_EQ(torchrun, "True");
    EXPECT_EQ(ddprun, "False");
  } else {
    EXPECT_EQ(ddprun, torchrun);
  }
}

void expect_same_environments(const Dumps& torchrun, const Dumps& ddprun) {
  std::set<std::string> torchrun_workers, ddprun_workers;
  for (const auto& [worker, env] : torchrun) torchrun_workers.insert(worker);
  for (const auto& [worker, env] : ddprun) ddprun_workers.insert(worker);
  ASSERT_FALSE(torchrun_workers.empty());
  ASSERT_EQ(ddprun_workers, torchrun_workers) << "the workers started (RANK.RESTART_COUNT) differ";
  for (const auto& [worker, torchrun_env] : torchrun) {
    const Env& ddprun_env = ddprun.at(worker);
    const std::string where = "worker " + worker;
    for (const auto& [key, value] : torchrun_env) {
      const auto found = ddprun_env.find(key);
      if (found == ddprun_env.end()) {
        ADD_FAILURE() << where << ": ddprun does not set " << key << "=" << value;
      } else {
        expect_same_variable(where, key, value, found->second);
      }
    }
    for (const auto& [key, value] : ddprun_env) {
      if (torchrun_env.count(key) == 0 && kDdprunExtras.count(key) == 0) {
        ADD_FAILURE() << where << ": only ddprun sets " << key << "=" << value;
      }
    }
  }
  // What is the same for a whole attempt must be the same for each of its workers.
  for (const Dumps* dumps : {&torchrun, &ddprun}) {
    std::map<std::string, Env> first_of_attempt;
    for (const auto& [worker, env] : *dumps) {
      const std::string attempt = worker.substr(worker.find('.') + 1);
      Env& first = first_of_attempt[attempt];
      if (first.empty()) first = env;
      for (const char* key : {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"}) {
        EXPECT_EQ(env.at(key), first.at(key)) << key << " differs within attempt " << attempt;
      }
    }
  }
}

void expect_same_as_torchrun(const std::vector<Agent>& agents, const std::string& then = "") {
  const std::string cwd = make_temp_dir("surface_cwd");  // PWD: the same for both
  Dumps torchrun = run_job(Launcher::kTorchrun, agents, cwd, then);
  Dumps ddprun = run_job(Launcher::kDdprun, agents, cwd, then);
  fs::remove_all(cwd);
  expect_same_environments(torchrun, ddprun);
}

class TorchrunSurface : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torchrun_available()) GTEST_SKIP() << DDP_PYTHON << " cannot import torch.distributed.run";
  }
};

TEST_F(TorchrunSurface, StandaloneWorkersSeeWhatTorchrunsSee) {
  expect_same_as_torchrun({{{"--standalone", "--nproc-per-node", "2"}, {}}});
}

TEST_F(TorchrunSurface, StaticTwoNodeWorkersSeeWhatTorchrunsSee) {
  const std::string port = std::to_string(free_port());
  std::vector<Agent> agents;
  for (const char* node_rank : {"0", "1"}) {
    agents.push_back({{"--nnodes", "2", "--node_rank", node_rank, "--nproc_per_node", "2", "--master-addr",
                       "127.0.0.1", "--master_port", port},
                      {}});
  }
  expect_same_as_torchrun(agents);
}

TEST_F(TorchrunSurface, ElasticC10dWorkersSeeWhatTorchrunsSee) {
  const std::string endpoint = "127.0.0.1:" + std::to_string(free_port());
  const Agent agent{{"--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "surface7", "--nnodes",
                     "1:2", "--nproc-per-node", "2", "--rdzv-conf", "last_call_timeout=1"},
                    {}};
  expect_same_as_torchrun({agent, agent});
}

TEST_F(TorchrunSurface, RoleAndVirtualLocalRankWorkersSeeWhatTorchrunsSee) {
  expect_same_as_torchrun({{{"--standalone", "--nproc-per-node", "2", "--role", "trainer"}, {}}});
  expect_same_as_torchrun({{{"--standalone", "--nproc-per-node", "2", "--virtual-local-rank"}, {}}});
  expect_same_as_torchrun(
      {{{"--standalone", "--nproc-per-node", "2", "--virtual_local_rank"}, {{"CUDA_VISIBLE_DEVICES", "3, 5,7"}}}});
}

TEST_F(TorchrunSurface, PetVariablesSetTheDefaultsAndTheCommandLineWins) {
  expect_same_as_torchrun({{{},
                            {{"PET_STANDALONE", "1"},
                             {"PET_NPROC_PER_NODE", "3"},
                             {"PET_ROLE", "pet_role"},
                             {"PET_MAX_RESTARTS", "2"},
                             {"PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGUSR2"},
                             {"PET_VIRTUAL_LOCAL_RANK", "0"}}}});
  expect_same_as_torchrun({{{"--nproc-per-node", "2", "--role", "flag_role"},
                            {{"PET_STANDALONE", "1"}, {"PET_NPROC_PER_NODE", "3"}, {"PET_ROLE", "pet_role"}}}});
}

// Kubeflow's PyTorchJob: each pod gets PET_* for torchrun plus the pod-level RANK, WORLD_SIZE,
// MASTER_ADDR and MASTER_PORT, and runs the launcher with no flags at all.
TEST_F(TorchrunSurface, APyTorchJobsPodEnvironmentWithNoFlagsGivesWhatTorchrunGives) {
  const std::string port = std::to_string(free_port());
  std::vector<Agent> pods;
  for (const char* pod : {"0", "1"}) {
    pods.push_back({{},
                    {{"PET_NNODES", "2"},
                     {"PET_NPROC_PER_NODE", "2"},
                     {"PET_NODE_RANK", pod},
                     {"PET_MASTER_ADDR", "127.0.0.1"},
                     {"PET_MASTER_PORT", port},
                     {"MASTER_ADDR", "127.0.0.1"},
                     {"MASTER_PORT", port},
                     {"WORLD_SIZE", "4"},
                     {"RANK", pod},
                     {"PYTHONUNBUFFERED", "0"}}});
  }
  expect_same_as_torchrun(pods);
}

TEST_F(TorchrunSurface, RestartedWorkersSeeWhatTorchrunsSee) {
  // Rank 1 fails on the first attempt once rank 0 has written its environment.
  const std::string fail_first =
      "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ] && [ \"$RANK\" = 1 ]; then i=0; "
      "while [ ! -e \"$0/env.0.0\" ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done; exit 3; fi";
  expect_same_as_torchrun({{{"--standalone", "--nproc-per-node", "2", "--max-restarts", "1"}, {}}}, fail_first);
}

// ---------------------------------------------------------------------------------------------
// ddprun alone: these need no torchrun.

ProcessResult ddprun(const std::vector<std::string>& args, std::vector<std::pair<std::string, std::string>> env = {}) {
  std::vector<std::string> argv = {bin_path("ddprun")};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_process(argv, clean(std::move(env), std::chrono::seconds(60)));
}

// The environment of each worker of one ddprun run, by "RANK.RESTART_COUNT".
Dumps ddprun_dumps(const std::vector<std::string>& flags, std::vector<std::pair<std::string, std::string>> env = {},
                   ProcessResult* result_out = nullptr) {
  const std::string dir = make_temp_dir("surface_ddprun");
  std::vector<std::string> args = flags;
  for (const std::string& word : dump_worker(dir)) args.push_back(word);
  ProcessResult result = ddprun(args, std::move(env));
  if (result_out != nullptr) *result_out = result;
  EXPECT_EQ(result.exit_code, 0) << result.describe();
  Dumps dumps = read_dumps(dir);
  fs::remove_all(dir);
  return dumps;
}

TEST(DdprunTorchrunFlags, HelpListsEveryTorchrunFlagWithItsDefault) {
  ProcessResult result = ddprun({"--help"});
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  const std::string& help = result.out;
  const std::vector<std::pair<std::string, std::string>> flags_and_defaults = {
      {"--nnodes", "(default: 1)"},
      {"--nproc-per-node", "(default: 1)"},
      {"--rdzv-backend", "(default: static)"},
      {"--rdzv-endpoint", "(default: none"},
      {"--rdzv-id", "(default: none)"},
      {"--rdzv-conf", "(default: 600)"},
      {"--standalone", "(default: off)"},
      {"--max-restarts", "(default: 0)"},
      {"--monitor-interval", "(default: 0.5)"},
      {"--start-method", "(default: spawn)"},
      {"--event-log-handler", "(default: null)"},
      {"--role", "(default: default)"},
      {"--module, -m", "(default: off)"},
      {"--no-python", "(default: off)"},
      {"--run-path", "(default: off)"},
      {"--log-dir", "(default: none"},
      {"--redirects SPEC, -r", "(default: 0"},
      {"--tee [SPEC], -t", "(default: off)"},
      {"--local-ranks-filter", "(default: none"},
      {"--duplicate-stdout-filters", "(default: none)"},
      {"--duplicate-stderr-filters", "(default: none)"},
      {"--node-rank", "(default: 0)"},
      {"--master-addr", "(default: 127.0.0.1)"},
      {"--master-port", "(default: 29500)"},
      {"--local-addr", "(default: none"},
      {"--logs-specs", "(default: default)"},
      {"--numa-binding", "(default: none)"},
      {"--signals-to-handle", "(default: SIGTERM,SIGINT,SIGHUP,SIGQUIT)"},
      {"--virtual-local-rank", "(default: off)"},
      {"--cpu-bind", "(default: none)"},
  };
  for (const auto& [name, default_text] : flags_and_defaults) {
    const size_t at = help.find("  " + name + " ");
    ASSERT_NE(at, std::string::npos) << name << " missing from\n" << help;
    const size_t next_flag = help.find("\n  -", at + 1);
    EXPECT_LT(help.find(default_text, at), next_flag) << name << " lacks " << default_text;
  }
  EXPECT_NE(help.find("PET_"), std::string::npos) << "the PET_* defaults are not explained";
}

// Every torchrun flag in each of its spellings parses; the no-ops change nothing.
TEST(DdprunTorchrunFlags, EverySpellingOfEveryTorchrunFlagIsAccepted) {
  const std::vector<std::vector<std::string>> spellings = {
      {"--nproc-per-node", "1"}, {"--nproc_per_node=1"}, {"--rdzv-backend", "static"}, {"--rdzv_backend=static"},
      {"--rdzv-id", "x"}, {"--rdzv_id=x"}, {"--rdzv-conf", "join_timeout=5"}, {"--rdzv_conf=join_timeout=5"},
      {"--max-restarts", "0"}, {"--max_restarts=0"}, {"--monitor-interval", "0.5"}, {"--monitor_interval=0.5"},
      {"--start-method", "spawn"}, {"--start_method=fork"}, {"--start-method", "forkserver"},
      {"--event-log-handler", "null"}, {"--event_log_handler=dynamic_rendezvous"}, {"--role", "r"}, {"--role=r"},
      {"--no-python"}, {"--no_python"}, {"-r", "0"}, {"-r0"}, {"--redirects", "0"}, {"-t", "0"}, {"-t0"},
      {"--tee=0"}, {"--local-ranks-filter", "0"}, {"--local_ranks_filter=0"},
      {"--duplicate-stdout-filters", "a,,b,c"}, {"--duplicate_stdout_filters=a"},
      {"--duplicate-stderr-filters", "a"}, {"--duplicate_stderr_filters=a"}, {"--node-rank", "0"},
      {"--node_rank=0"}, {"--master-addr", "127.0.0.1"}, {"--master_addr=127.0.0.1"}, {"--master-port", "29500"},
      {"--master_port=29500"}, {"--local-addr", "127.0.0.1"}, {"--local_addr=127.0.0.1"},
      {"--logs-specs", "default"}, {"--logs_specs=default"}, {"--signals-to-handle", "SIGTERM,SIGUSR2"},
      {"--signals_to_handle=SIGTERM"}, {"--virtual-local-rank"}, {"--virtual_local_rank"}, {"--nnodes", "1"},
      {"--nnodes=1"}, {"--standalone"}, {"--cpu-bind", "none"}, {"--cpu_bind=none"},
  };
  for (const auto& flag : spellings) {
    SCOPED_TRACE(flag.front());
    std::vector<std::string> args = flag;
    args.push_back("true");
    ProcessResult result = ddprun(args);
    EXPECT_EQ(result.exit_code, 0) << result.describe();
  }
}

TEST(DdprunTorchrunFlags, PythonOnlyAndBadValuesAreRefusedInOneLineNamingTheCause) {
  struct Case {
    std::vector<std::string> args;
    std::vector<std::pair<std::string, std::string>> env;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {{"--module", "true"}, {}, "--module runs PROGRAM as a Python module"},
      {{"-m", "true"}, {}, "python3 -m MODULE"},
      {{"--run-path", "true"}, {}, "--run-path runs a script inside torchrun's own Python interpreter"},
      {{"--start-method", "thread", "true"}, {}, "'thread' for --start-method"},
      {{"--event-log-handler", "console", "true"}, {}, "records no torchelastic events"},
      {{"--logs-specs", "mine", "true"}, {}, "a LogsSpecs class is a Python entry point"},
      {{"--numa-binding", "everywhere", "true"}, {}, "'everywhere' for --numa-binding"},
      {{"--cpu-bind", "sockets", "true"}, {}, "'sockets' for --cpu-bind"},
      {{"--redirects", "4", "true"}, {}, "'4' for --redirects"},
      {{"-t", "0:5", "true"}, {}, "'0:5' for -t"},
      {{"--local-ranks-filter", "a", "true"}, {}, "'a' for --local-ranks-filter"},
      {{"--signals-to-handle", "SIGKILL", "true"}, {}, "SIGKILL cannot be caught"},
      {{"--signals-to-handle", "SIGTERM,SIGFOO", "true"}, {}, "unknown signal 'SIGFOO'"},
      {{"--role=", "true"}, {}, "'' for --role"},
      {{"--virtual-local-rank=1", "true"}, {}, "--virtual-local-rank takes no value"},
      {{"true"}, {{"PET_STANDALONE", "yes"}}, "'yes' for PET_STANDALONE"},
      {{"true"}, {{"PET_NPROC_PER_NODE", "two"}}, "'two' for PET_NPROC_PER_NODE"},
      {{"true"}, {{"PET_MODULE", "1"}}, "PET_MODULE runs PROGRAM as a Python module"},
      {{"true"}, {{"PET_MASTER_PORT", "0"}}, "'0' for PET_MASTER_PORT"},
      {{"--virtual-local-rank", "--nproc-per-node", "3", "true"},
       {{"CUDA_VISIBLE_DEVICES", "0,1"}},
       "local rank 2 has none"},
  };
  for (const Case& c : cases) {
    std::string joined;
    for (const auto& [key, value] : c.env) joined += key + "=" + value + " ";
    joined += "ddprun";
    for (const std::string& arg : c.args) joined += " " + arg;
    SCOPED_TRACE(joined);
    ProcessResult result = ddprun(c.args, c.env);
    EXPECT_EQ(result.exit_code, 2) << result.describe();
    EXPECT_NE(result.err.find(c.expected), std::string::npos) << result.describe();
    EXPECT_EQ(std::count(result.err.begin(), result.err.end(), '\n'), 1) << "a one-line error, "
                                                                         << result.describe();
  }
}

TEST(DdprunTorchrunFlags, PetVariablesAreDefaultsThatTheCommandLineOverrides) {
  Dumps dumps = ddprun_dumps({}, {{"PET_NPROC_PER_NODE", "3"}, {"PET_ROLE", "from_env"}, {"PET_STANDALONE", "1"},
                                  {"PET_MAX_RESTARTS", "2"}, {"PET_RDZV_ID", "pet-id"}});
  ASSERT_EQ(dumps.size(), 3u);
  EXPECT_EQ(dumps["2.0"]["WORLD_SIZE"], "3");
  EXPECT_EQ(dumps["2.0"]["ROLE_NAME"], "from_env");
  EXPECT_EQ(dumps["2.0"]["TORCHELASTIC_MAX_RESTARTS"], "2");
  EXPECT_EQ(dumps["2.0"]["TORCHELASTIC_RUN_ID"], "pet-id");
  EXPECT_EQ(dumps["2.0"]["MASTER_ADDR"], "127.0.0.1");  // standalone
  dumps = ddprun_dumps({"--nproc_per_node", "2", "--role", "from_flag", "--run-id", "flag-id"},
                       {{"PET_NPROC_PER_NODE", "3"}, {"PET_ROLE", "from_env"}, {"PET_STANDALONE", "0"},
                        {"PET_RDZV_ID", "pet-id"}, {"PET_MASTER_PORT", "29517"}});
  ASSERT_EQ(dumps.size(), 2u);
  EXPECT_EQ(dumps["1.0"]["ROLE_NAME"], "from_flag");
  EXPECT_EQ(dumps["1.0"]["TORCHELASTIC_RUN_ID"], "flag-id");
  EXPECT_EQ(dumps["1.0"]["MASTER_PORT"], "29517");  // PET_STANDALONE=0 is off
}

// torchrun's worker variables that ddprun did not set before, with torchrun's values.
TEST(DdprunTorchrunFlags, WorkersGetTorchrunsRoleSignalAndStoreVariables) {
  Dumps dumps = ddprun_dumps({"--nproc-per-node", "2", "--role", "trainer"});
  ASSERT_EQ(dumps.size(), 2u);
  const Env& env = dumps["1.0"];
  EXPECT_EQ(env.at("ROLE_NAME"), "trainer");
  EXPECT_EQ(env.at("ROLE_RANK"), "1");
  EXPECT_EQ(env.at("ROLE_WORLD_SIZE"), "2");
  EXPECT_EQ(env.at("TORCHELASTIC_SIGNALS_TO_HANDLE"), "SIGTERM,SIGINT,SIGHUP,SIGQUIT");
  EXPECT_EQ(env.at("TORCHELASTIC_USE_AGENT_STORE"), "False");
  EXPECT_EQ(env.at("TORCH_NCCL_ASYNC_ERROR_HANDLING"), "1");
  // ddprun's own: ddp's stack dump on SIGUSR1 and its terminate handler are on for its workers.
  EXPECT_EQ(env.at("DDP_DIAGNOSTIC_HANDLERS"), "1");
  // The user's own choice passes through.
  dumps = ddprun_dumps({"--signals-to-handle", "SIGTERM,SIGUSR2"},
                       {{"TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"}, {"DDP_DIAGNOSTIC_HANDLERS", "0"}});
  EXPECT_EQ(dumps["0.0"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"], "3");
  EXPECT_EQ(dumps["0.0"]["DDP_DIAGNOSTIC_HANDLERS"], "0");
  EXPECT_EQ(dumps["0.0"]["TORCHELASTIC_SIGNALS_TO_HANDLE"], "SIGTERM,SIGUSR2");
  // --standalone makes up a fresh run id, as torchrun does, unless one is given.
  dumps = ddprun_dumps({"--standalone"});
  EXPECT_TRUE(is_uuid(dumps["0.0"]["TORCHELASTIC_RUN_ID"])) << dumps["0.0"]["TORCHELASTIC_RUN_ID"];
  EXPECT_EQ(dumps["0.0"]["DDP_RUN_ID"], dumps["0.0"]["TORCHELASTIC_RUN_ID"]);
}

TEST(DdprunTorchrunFlags, VirtualLocalRankGivesEachWorkerLocalRankZeroAndItsOwnDevice) {
  Dumps dumps = ddprun_dumps({"--nproc-per-node", "3", "--virtual-local-rank"});
  ASSERT_EQ(dumps.size(), 3u);
  for (int rank = 0; rank < 3; ++rank) {
    const Env& env = dumps[std::to_string(rank) + ".0"];
    EXPECT_EQ(env.at("LOCAL_RANK"), "0");
    EXPECT_EQ(env.at("RANK"), std::to_string(rank));
    EXPECT_EQ(env.at("CUDA_VISIBLE_DEVICES"), std::to_string(rank));
  }
  dumps = ddprun_dumps({"--nproc-per-node", "2", "--virtual-local-rank"}, {{"CUDA_VISIBLE_DEVICES", "5, 7"}});
  EXPECT_EQ(dumps["0.0"]["CUDA_VISIBLE_DEVICES"], "5");
  EXPECT_EQ(dumps["1.0"]["CUDA_VISIBLE_DEVICES"], "7");
  EXPECT_EQ(dumps["1.0"]["LOCAL_RANK"], "0");
  // Without the flag the parent's list passes through and LOCAL_RANK is the local rank.
  dumps = ddprun_dumps({"--nproc-per-node", "2"}, {{"CUDA_VISIBLE_DEVICES", "5,7"}});
  EXPECT_EQ(dumps["1.0"]["CUDA_VISIBLE_DEVICES"], "5,7");
  EXPECT_EQ(dumps["1.0"]["LOCAL_RANK"], "1");
}

// A sh worker that reports `signal` and exits 0 when it gets it, after saying it is ready.
std::vector<std::string> trapping_worker(const std::string& dir, const std::string& signal) {
  return {"/bin/sh", "-c",
          "trap 'echo \"rank $RANK got " + signal + "\"; exit 0' " + signal +
              "; touch \"$0/ready.$RANK\"; i=0; while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done; exit 9",
          dir};
}

// Sends `signal` to a ddprun running `flags` with two trapping workers once both are ready.
ProcessResult signal_ddprun(const std::vector<std::string>& flags, int signal, const std::string& name) {
  const std::string dir = make_temp_dir("surface_signal");
  std::vector<std::string> argv = {bin_path("ddprun"), "--nproc-per-node", "2"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  for (const std::string& word : trapping_worker(dir, name)) argv.push_back(word);
  BackgroundProcess launcher = start_background(argv, clean({}, std::chrono::seconds(60)));
  for (int i = 0; i < 200 && !(fs::exists(dir + "/ready.0") && fs::exists(dir + "/ready.1")); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(fs::exists(dir + "/ready.0") && fs::exists(dir + "/ready.1")) << "the workers never got ready";
  ::kill(launcher.pid, signal);
  ProcessResult result = wait_background(launcher, std::chrono::seconds(30));
  fs::remove_all(dir);
  return result;
}

TEST(DdprunTorchrunFlags, SigquitIsForwardedByDefaultAndSignalsToHandleAddsSigusr2) {
  ProcessResult result = signal_ddprun({}, SIGQUIT, "QUIT");
  EXPECT_EQ(result.exit_code, 128 + SIGQUIT) << result.describe();
  EXPECT_NE(result.out.find("[rank0]: rank 0 got QUIT"), std::string::npos) << result.describe();
  EXPECT_NE(result.out.find("[rank1]: rank 1 got QUIT"), std::string::npos) << result.describe();

  result = signal_ddprun({"--signals-to-handle", "SIGTERM,SIGUSR2"}, SIGUSR2, "USR2");
  EXPECT_EQ(result.exit_code, 128 + SIGUSR2) << result.describe();
  EXPECT_NE(result.out.find("[rank1]: rank 1 got USR2"), std::string::npos) << result.describe();

  // Left out of the list, SIGHUP is not caught: it ends ddprun as it would any program, and the
  // workers go with it.
  result = signal_ddprun({"--signals-to-handle", "SIGTERM"}, SIGHUP, "HUP");
  EXPECT_EQ(result.term_signal, SIGHUP) << result.describe();
  EXPECT_EQ(result.out.find("got HUP"), std::string::npos) << result.describe();
}

}  // namespace
