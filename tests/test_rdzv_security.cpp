// ddprun's rendezvous store against strangers (issue 21, items 2 and 3): a job secret proven by
// challenge and response, requests accepted only from the agent that owns the connection, and a
// server loop that survives connection floods and bursts. Real ddprun agents on 127.0.0.1, and
// raw sockets speaking the store's framing for the attacker.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "hmac_sha256.h"
#include "rdzv_wire.h"
#include "support/rdzv_agents.h"
#include "support/subprocess.h"

namespace {

using namespace std::chrono_literals;
using ddp::testing::BackgroundProcess;
using ddp::testing::bin_path;
using ddp::testing::ProcessResult;
using ddp::testing::RunOptions;
using Message = std::vector<std::string>;
using Clock = std::chrono::steady_clock;

constexpr const char* kProtocol = "ddprun-rdzv-2";

std::string hex_of(const ddprun::Sha256Digest& digest) { return ddprun::to_hex(digest); }
std::string bytes(size_t count, char value) { return std::string(count, value); }
std::string unhex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out += static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16));
  return out;
}

// Known answers for our thin wrapper over libcrypto's HMAC (hmac_sha256.cpp).
TEST(HmacSha256, MatchesTheRfc4231Vectors) {
  // RFC 4231 test cases 1, 2, 3, 4, 6 and 7 (5 truncates the output).
  EXPECT_EQ(hex_of(ddprun::hmac_sha256(bytes(20, '\x0b'), "Hi There")),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  EXPECT_EQ(hex_of(ddprun::hmac_sha256("Jefe", "what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  EXPECT_EQ(hex_of(ddprun::hmac_sha256(bytes(20, '\xaa'), bytes(50, '\xdd'))),
            "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe");
  EXPECT_EQ(hex_of(ddprun::hmac_sha256(unhex("0102030405060708090a0b0c0d0e0f10111213141516171819"), bytes(50, '\xcd'))),
            "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b");
  EXPECT_EQ(hex_of(ddprun::hmac_sha256(bytes(131, '\xaa'), "Test Using Larger Than Block-Size Key - Hash Key First")),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  EXPECT_EQ(hex_of(ddprun::hmac_sha256(bytes(131, '\xaa'),
                                       "This is a test using a larger than block-size key and a larger than "
                                       "block-size data. The key needs to be hashed before being used by the HMAC "
                                       "algorithm.")),
            "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2");
  EXPECT_TRUE(ddprun::equal_in_constant_time("abc", "abc"));
  EXPECT_FALSE(ddprun::equal_in_constant_time("abc", "abd"));
  EXPECT_FALSE(ddprun::equal_in_constant_time("abc", "abcd"));
  EXPECT_NE(ddprun::random_hex(16), ddprun::random_hex(16));
  EXPECT_EQ(ddprun::random_hex(16).size(), 32u);
}

// A store without a secret authenticates with the empty key, which libcrypto must read as a
// zero-length key; and the proofs on the wire are the ones ddprun computed before it used
// libcrypto (values from Python's hmac module), so that agents of both builds still meet.
TEST(HmacSha256, EmptyKeyAndTheHandshakeProofsAreUnchanged) {
  EXPECT_EQ(hex_of(ddprun::hmac_sha256("", "")), "b613679a0814d9ec772f95d778c35fc5ff1697c493715653c6c712144292c5ad");
  EXPECT_EQ(ddprun::rdzv_wire::server_proof("", "c0ffee", "facade"),
            "7263515260f595b736d44d3cd09b7d31a762ebc254c623257d08e153106c5ae1");
  EXPECT_EQ(ddprun::rdzv_wire::client_proof("", "facade", "c0ffee"),
            "124cb8d0fa29ac652b4da169d6eb35b5fbd89661dba1522ea756f4190ccf47c8");
  EXPECT_EQ(ddprun::rdzv_wire::server_proof("job-secret", "c0ffee", "facade"),
            "ead603f889a862d6c7f65623609f6b6f9c6e1c07a39e5b0c1558bace38735ab0");
  EXPECT_EQ(ddprun::rdzv_wire::client_proof("job-secret", "facade", "c0ffee"),
            "84b13b3adc1948c85e951a713d1388220de6680cbea9bddcd2dfda9dc9c683e6");
}

// ---------------------------------------------------------------------------------------------
// The store's framing, as an outsider would write it: u32 length | u32 count | (u32 len, bytes)*.

void put_u32(std::string& out, uint32_t value) {
  const uint32_t big = htonl(value);
  out.append(reinterpret_cast<const char*>(&big), 4);
}

std::string encode(const Message& message) {
  std::string body;
  put_u32(body, static_cast<uint32_t>(message.size()));
  for (const std::string& field : message) {
    put_u32(body, static_cast<uint32_t>(field.size()));
    body += field;
  }
  std::string frame;
  put_u32(frame, static_cast<uint32_t>(body.size()));
  return frame + body;
}

uint32_t get_u32(const std::string& in, size_t at) {
  uint32_t big = 0;
  std::memcpy(&big, in.data() + at, 4);
  return ntohl(big);
}

// Takes one whole frame from the front of buffer, if there is one.
bool take_frame(std::string& buffer, Message* message) {
  if (buffer.size() < 4 || buffer.size() < 4 + get_u32(buffer, 0)) return false;
  const std::string body = buffer.substr(4, get_u32(buffer, 0));
  buffer.erase(0, 4 + body.size());
  message->clear();
  size_t at = 4;
  for (uint32_t i = 0, count = get_u32(body, 0); i < count && at + 4 <= body.size(); ++i) {
    const uint32_t size = get_u32(body, at);
    message->push_back(body.substr(at + 4, size));
    at += 4 + size;
  }
  return true;
}

int connect_to(int port, bool wait = true) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | (wait ? 0 : SOCK_NONBLOCK), 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 && errno != EINPROGRESS) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// A raw connection to the store.
class RawPeer {
 public:
  explicit RawPeer(int port) : fd_(connect_to(port)) {}
  ~RawPeer() {
    if (fd_ >= 0) ::close(fd_);
  }
  bool connected() const { return fd_ >= 0; }
  void send_raw(const std::string& data) {
    size_t sent = 0;
    while (sent < data.size()) {
      const ssize_t n = ::send(fd_, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return;
      sent += static_cast<size_t>(n);
    }
  }
  void send(const Message& message) { send_raw(encode(message)); }
  void shutdown_writing() { ::shutdown(fd_, SHUT_WR); }
  // The next reply; empty if none came in time or the store closed the connection.
  Message receive(std::chrono::milliseconds timeout = 3s) {
    const auto deadline = Clock::now() + timeout;
    Message reply;
    while (!take_frame(buffer_, &reply)) {
      pollfd p{fd_, POLLIN, 0};
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (::poll(&p, 1, static_cast<int>(std::max<long long>(left, 0))) <= 0) return {};
      char chunk[65536];
      const ssize_t n = ::recv(fd_, chunk, sizeof chunk, 0);
      if (n <= 0) {
        closed_ = true;
        return {};
      }
      buffer_.append(chunk, static_cast<size_t>(n));
    }
    got_challenge_ = got_challenge_ || (!reply.empty() && reply[0] == "challenge");
    return reply;
  }
  // Whether a challenge came (now or earlier).
  bool greeted(std::chrono::milliseconds timeout) {
    if (!got_challenge_) receive(timeout);
    return got_challenge_;
  }
  Message ask(const Message& message) {
    send(message);
    return receive();
  }
  // True once the store closed its side (reading what is left until then).
  bool closed_by_store(std::chrono::milliseconds timeout = 3s) {
    while (!closed_ && !receive(timeout).empty()) {
    }
    return closed_;
  }
  // The challenge and response with `secret` (empty: a store without one). Returns the store's
  // last answer.
  Message authenticate(const std::string& secret) {
    const std::string client_nonce = "0123456789abcdef";
    Message challenge = ask({"HELLO", kProtocol, client_nonce});
    if (challenge.size() < 4 || challenge[0] != "challenge") return challenge;
    return ask({"AUTH", ddprun::to_hex(ddprun::hmac_sha256(secret, "client\n" + challenge[2] + "\n" + client_nonce))});
  }

 private:
  int fd_;
  std::string buffer_;
  bool closed_ = false;
  bool got_challenge_ = false;
};

using ddp::testing::read_text_file;

size_t count_of(const std::string& text, const std::string& what) {
  size_t count = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++count;
  return count;
}

// CPU seconds (user + system) the process has used so far.
double cpu_seconds(int pid) {
  std::istringstream stat(read_text_file("/proc/" + std::to_string(pid) + "/stat"));
  std::string field;
  std::vector<std::string> fields;
  while (stat >> field) fields.push_back(field);
  if (fields.size() < 15) return -1;
  return (std::stod(fields[13]) + std::stod(fields[14])) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

// Raises this process's descriptor limit (inherited by the agents) to `wanted`; false if the
// hard limit is lower.
bool allow_descriptors(rlim_t wanted) {
  rlimit files{};
  if (::getrlimit(RLIMIT_NOFILE, &files) != 0) return false;
  if (files.rlim_cur >= wanted) return true;
  if (files.rlim_max != RLIM_INFINITY && files.rlim_max < wanted) return false;
  files.rlim_cur = wanted;
  return ::setrlimit(RLIMIT_NOFILE, &files) == 0;
}

// ---------------------------------------------------------------------------------------------

using Agent = ddp::testing::RdzvAgent;

class RdzvSecurity : public ::testing::Test {
 protected:
  void SetUp() override {
    port_ = ddp::testing::free_port();
    dir_ = ddp::testing::make_temp_dir("rdzv_security");
  }
  void TearDown() override {
    ddp::testing::finish_agents(agents_);
    std::string ignored = "rm -rf '" + dir_ + "'";
    EXPECT_EQ(std::system(ignored.c_str()), 0);
  }

  std::string endpoint() const { return "127.0.0.1:" + std::to_string(port_); }

  std::string write_secret(const std::string& name, const std::string& secret, mode_t mode = 0600) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path) << secret << "\n";
    ::chmod(path.c_str(), mode);
    return path;
  }

  // Starts an agent of `nodes` nodes (--local-addr 127.0.0.<2+index>) running `program`; the
  // first one hosts the store. `wrapper` goes before ddprun (e.g. valgrind).
  Agent& start_agent(const std::vector<std::string>& flags, const std::vector<std::string>& program,
                     const std::vector<std::string>& wrapper = {}) {
    std::vector<std::string> argv = wrapper;
    const std::vector<std::string> args = {bin_path("ddprun"), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint(),
                                           "--local-addr", "127.0.0." + std::to_string(2 + agents_.size()),
                                           "--rdzv-id", run_id_};
    argv.insert(argv.end(), args.begin(), args.end());
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.insert(argv.end(), program.begin(), program.end());
    RunOptions options;
    options.env = {{"OMP_NUM_THREADS", "1"}};
    options.unset_env = {"DDP_RDZV_SECRET_FILE"};
    options.timeout = 60s;
    agents_.emplace_back();
    agents_.back().process = ddp::testing::start_background(argv, options);
    return agents_.back();
  }

  bool wait_for_err(const Agent& agent, const std::string& text, std::chrono::milliseconds timeout = 15s) {
    return ddp::testing::wait_for_err(agent, text, timeout);
  }

  std::string everything() { return ddp::testing::describe_agents(agents_); }

  // A worker that lives long enough for the forgeries to land mid-round, then prints its rank.
  static std::vector<std::string> worker() {
    return {"/bin/sh", "-c", "sleep 2; echo \"rank $RANK of $WORLD_SIZE finished\""};
  }

  int port_ = 0;
  std::string dir_;
  std::string run_id_ = "job-7f3a";
  std::deque<Agent> agents_;
};

// Every forgery an outsider without the secret can send: the old protocol's JOIN, LEAVE and
// REPORT with the ids the old store handed out, and a handshake with a wrong secret.
void forge_everything(int port, const std::string& secret, const std::string& run_id) {
  const std::vector<Message> forgeries = {
      {"JOIN", kProtocol, run_id, "evil", "127.0.0.66", "1", "1", "0"},
      {"LEAVE", "agent1"},
      {"REPORT", "agent1", "0", "failed", "1", "0", "0", "666", "exit code 9", "PWNED root cause", "", "0", "", "0",
       "0", "evil-host"},
      {"HELLO", "ddprun-rdzv-1", "00"},
  };
  for (const Message& forgery : forgeries) {
    RawPeer peer(port);
    ASSERT_TRUE(peer.connected());
    const Message reply = peer.ask(forgery);
    ASSERT_GE(reply.size(), 2u) << forgery[0];
    EXPECT_EQ(reply[0], "refused") << forgery[0];
    EXPECT_EQ(reply[1].find(run_id), std::string::npos) << reply[1];
    EXPECT_EQ(reply[1].find(secret), std::string::npos) << reply[1];
    EXPECT_TRUE(peer.closed_by_store()) << "a refused connection is closed: " << forgery[0];
  }
  RawPeer guesser(port);
  const Message refusal = guesser.authenticate("not the secret at all");
  ASSERT_GE(refusal.size(), 2u);
  EXPECT_EQ(refusal[0], "refused");
  EXPECT_NE(refusal[1].find("authentication failed"), std::string::npos) << refusal[1];
  EXPECT_EQ(refusal[1].find(run_id), std::string::npos) << refusal[1];
  EXPECT_EQ(refusal[1].find(secret), std::string::npos) << refusal[1];
  EXPECT_TRUE(guesser.closed_by_store());
}

TEST_F(RdzvSecurity, WithASecretForgedJoinLeaveAndReportAreRefusedAndTheJobSucceeds) {
  const std::string secret = "s3cret-" + ddprun::random_hex(16);
  const std::string file = write_secret("secret", secret);
  for (int n = 0; n < 2; ++n) {
    start_agent({"--nnodes", "2", "--rdzv-secret-file", file}, worker());
    if (n == 0) ASSERT_TRUE(wait_for_err(agents_[0], "hosting the rendezvous store")) << everything();
  }
  ASSERT_TRUE(wait_for_err(agents_[1], "rendezvous round 0")) << everything();
  forge_everything(port_, secret, run_id_);
  for (size_t n = 0; n < agents_.size(); ++n) {
    ProcessResult& r = agents_[n].finish();
    EXPECT_EQ(r.exit_code, 0) << everything();
    EXPECT_NE(r.out.find("rank " + std::to_string(n) + " of 2 finished"), std::string::npos) << everything();
    EXPECT_EQ(r.err.find("PWNED"), std::string::npos) << everything();
    EXPECT_EQ(r.err.find("evil"), std::string::npos) << everything();
    EXPECT_EQ(r.err.find("restart"), std::string::npos) << everything();
    EXPECT_EQ(r.err.find("no secret"), std::string::npos) << "a store with a secret does not warn: " << everything();
  }
}

TEST_F(RdzvSecurity, WithoutASecretTheHostWarnsOnceAndNoOneCanSpeakForAnotherNode) {
  for (int n = 0; n < 2; ++n) {
    start_agent({"--nnodes", "2"}, worker());
    if (n == 0) ASSERT_TRUE(wait_for_err(agents_[0], "hosting the rendezvous store")) << everything();
  }
  ASSERT_TRUE(wait_for_err(agents_[1], "rendezvous round 0")) << everything();
  // Without a secret anyone may pass the handshake, but a LEAVE or REPORT must still name a node
  // whose id is random, and come on that node's own connection.
  RawPeer stranger(port_);
  ASSERT_EQ(stranger.authenticate(""), (Message{"ok"}));
  for (const std::string id : {"agent0", "agent1", "agent2"}) {
    EXPECT_NE(stranger.ask({"LEAVE", id}).at(0), "ok") << id;
    EXPECT_NE(stranger.ask({"REPORT", id, "0", "failed", "1", "0", "0", "1", "x", "PWNED"}).at(0), "ok") << id;
  }
  for (Agent& agent : agents_) {
    ProcessResult& r = agent.finish();
    EXPECT_EQ(r.exit_code, 0) << everything();
    EXPECT_EQ(r.err.find("PWNED"), std::string::npos) << everything();
  }
  EXPECT_EQ(count_of(agents_[0].result.err, "the rendezvous store has no secret"), 1u) << everything();
  EXPECT_NE(agents_[0].result.err.find("anyone who can reach " + endpoint()), std::string::npos) << everything();
  EXPECT_EQ(count_of(agents_[1].result.err, "no secret"), 0u) << everything();
}

TEST_F(RdzvSecurity, ANodeWithAnotherSecretIsToldSoAtOnce) {
  start_agent({"--nnodes", "2", "--rdzv-secret-file", write_secret("a", "first-secret-0123456789")}, worker());
  ASSERT_TRUE(wait_for_err(agents_[0], "hosting the rendezvous store")) << everything();
  start_agent({"--nnodes", "2", "--rdzv-secret-file", write_secret("b", "other-secret-0123456789")}, worker());
  ProcessResult& stranger = agents_[1].finish(15s);
  EXPECT_EQ(stranger.exit_code, 1) << everything();
  EXPECT_NE(stranger.err.find("does not know this node's secret"), std::string::npos) << everything();
  EXPECT_LT(stranger.seconds, 5.0) << "refused at once, not after the join timeout: " << everything();
  EXPECT_EQ(stranger.err.find("first-secret"), std::string::npos) << everything();
}

TEST_F(RdzvSecurity, ASecretFileOthersCanReadOrAShortSecretIsRefused) {
  start_agent({"--nnodes", "1", "--rdzv-secret-file", write_secret("open", "long-enough-secret-0123", 0644)}, worker());
  ProcessResult& open = agents_.back().finish(10s);
  EXPECT_NE(open.exit_code, 0) << everything();
  EXPECT_NE(open.err.find("chmod 600"), std::string::npos) << everything();
  start_agent({"--nnodes", "1", "--rdzv-secret-file", write_secret("short", "short")}, worker());
  ProcessResult& short_one = agents_.back().finish(10s);
  EXPECT_NE(short_one.exit_code, 0) << everything();
  EXPECT_NE(short_one.err.find("holds 5 bytes"), std::string::npos) << everything();
}

// Issue 34, item 6: a secret "file" that is no regular file. A FIFO used to hang ddprun in
// open() for good, deaf to SIGTERM and Ctrl-C; each must be refused at once, naming what it is.
TEST_F(RdzvSecurity, ASecretPathThatIsAFifoDirectoryDeviceOrLinkToOneIsRefusedAtOnce) {
  const std::string fifo = dir_ + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  const std::string directory = dir_ + "/directory";
  ASSERT_EQ(::mkdir(directory.c_str(), 0700), 0);
  const std::string link_to_fifo = dir_ + "/link-to-fifo";
  ASSERT_EQ(::symlink(fifo.c_str(), link_to_fifo.c_str()), 0);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {fifo, "is a FIFO (named pipe), not a regular file"},
      {directory, "is a directory, not a regular file"},
      {"/dev/zero", "is a character device, not a regular file"},
      {link_to_fifo, "is a FIFO (named pipe), not a regular file"},
  };
  for (const auto& [path, refusal] : cases) {
    start_agent({"--nnodes", "1", "--rdzv-secret-file", path}, worker());
    ProcessResult& r = agents_.back().finish(10s);
    EXPECT_FALSE(r.timed_out) << path << " hung ddprun: " << everything();
    EXPECT_EQ(r.exit_code, 1) << path << ": " << everything();
    EXPECT_NE(r.err.find("the rendezvous secret file '" + path + "' " + refusal), std::string::npos) << everything();
    EXPECT_LT(r.seconds, 5.0) << path << ": " << everything();
  }
  // A link to a private regular file is what Kubernetes mounts; it is read as the file it names.
  const std::string file = write_secret("real", "linked-secret-" + ddprun::random_hex(8));
  const std::string link_to_file = dir_ + "/link-to-file";
  ASSERT_EQ(::symlink(file.c_str(), link_to_file.c_str()), 0);
  start_agent({"--nnodes", "1", "--rdzv-secret-file", link_to_file}, worker());
  ProcessResult& linked = agents_.back().finish(30s);
  EXPECT_EQ(linked.exit_code, 0) << everything();
  EXPECT_NE(linked.out.find("rank 0 of 1 finished"), std::string::npos) << everything();
}

// Issue 34, item 7: a node's host name is printed by every other node; one holding a newline
// could forge their console lines, so the store refuses it.
TEST_F(RdzvSecurity, AJoinWhoseHostNameHoldsANewlineIsRefused) {
  start_agent({"--nnodes", "2"}, worker());
  ASSERT_TRUE(wait_for_err(agents_[0], "hosting the rendezvous store")) << everything();
  RawPeer stranger(port_);
  ASSERT_EQ(stranger.authenticate(""), (Message{"ok"}));
  const Message reply =
      stranger.ask({"JOIN", kProtocol, run_id_, "evil\nddprun: FORGED line", "127.0.0.66", "1", "1", "0"});
  ASSERT_GE(reply.size(), 2u);
  EXPECT_EQ(reply[0], "refused");
  EXPECT_NE(reply[1].find("control character"), std::string::npos) << reply[1];
  start_agent({"--nnodes", "2"}, worker());
  for (Agent& agent : agents_) {
    ProcessResult& r = agent.finish();
    EXPECT_EQ(r.exit_code, 0) << everything();
    EXPECT_EQ(r.err.find("FORGED"), std::string::npos) << everything();
  }
}

// ---------------------------------------------------------------------------------------------
// Item 3: the server loop under load.

// Opens `count` connections that never speak, a few at a time as a trickle would.
std::vector<int> open_idle_connections(int port, int count) {
  std::vector<int> fds;
  for (int i = 0; i < count; ++i) {
    const int fd = connect_to(port, /*wait=*/false);
    if (fd >= 0) fds.push_back(fd);
    if (i % 100 == 99) std::this_thread::sleep_for(20ms);
  }
  return fds;
}

TEST_F(RdzvSecurity, ThirteenHundredIdleConnectionsNeitherSpinTheStoreNorLockOutAnAgent) {
  if (!allow_descriptors(4096)) GTEST_SKIP() << "needs 4096 file descriptors (ulimit -Hn is lower)";
  const std::string file = write_secret("secret", "flood-secret-" + ddprun::random_hex(8));
  Agent& host = start_agent({"--nnodes", "2", "--rdzv-secret-file", file}, worker());
  ASSERT_TRUE(wait_for_err(host, "hosting the rendezvous store")) << everything();
  std::vector<int> flood = open_idle_connections(port_, 1300);
  ASSERT_EQ(flood.size(), 1300u);
  const double cpu_before = cpu_seconds(host.process.pid);
  std::this_thread::sleep_for(2s);
  const double cpu_during = cpu_seconds(host.process.pid) - cpu_before;
  EXPECT_LT(cpu_during, 0.3) << "the store spun for 2 s of idle connections";
  // Within the unauthenticated connections' 5 s: only evicting them makes room.
  const auto joined_at = Clock::now();
  Agent& late = start_agent({"--nnodes", "2", "--rdzv-secret-file", file}, worker());
  EXPECT_TRUE(wait_for_err(late, "rendezvous round 0", 5s)) << everything();
  const double join_seconds = std::chrono::duration<double>(Clock::now() - joined_at).count();
  EXPECT_LT(join_seconds, 1.5) << everything();
  for (Agent& agent : agents_) EXPECT_EQ(agent.finish().exit_code, 0) << everything();
  // The store hung up on every one of them (evicted, or past the 5 s handshake deadline).
  size_t hung_up = 0;
  for (int fd : flood) {
    pollfd p{fd, POLLIN, 0};
    char byte;
    if (::poll(&p, 1, 0) == 1 && ::recv(fd, &byte, 1, MSG_DONTWAIT) <= 0) ++hung_up;
    ::close(fd);
  }
  EXPECT_EQ(hung_up, flood.size());
  std::cerr << "store CPU during the flood: " << cpu_during << " s in 2 s; late agent joined in " << join_seconds
            << " s\n";
}

TEST_F(RdzvSecurity, FifteenHundredBackToBackRequestsAreAllAnswered) {
  Agent& host = start_agent({"--nnodes", "2", "--rdzv-conf", "join_timeout=20"}, worker());
  ASSERT_TRUE(wait_for_err(host, "hosting the rendezvous store")) << everything();
  // One burst on one connection, written before a single reply is read, then half-closed.
  RawPeer burst(port_);
  ASSERT_EQ(burst.authenticate(""), (Message{"ok"}));
  std::string requests;
  for (int i = 0; i < 1500; ++i) requests += encode({"POLL", "no-such-agent-" + std::to_string(i)});
  burst.send_raw(requests);
  burst.shutdown_writing();
  int answered = 0;
  while (!burst.receive(5s).empty()) ++answered;
  EXPECT_EQ(answered, 1500) << "dropped " << 1500 - answered;
  // And 1,500 connections one after another, each asking once.
  int greeted = 0;
  for (int i = 0; i < 1500; ++i) {
    RawPeer peer(port_);
    greeted += peer.ask({"HELLO", kProtocol, "ab"}).size() == 4 ? 1 : 0;
  }
  EXPECT_EQ(greeted, 1500) << "dropped " << 1500 - greeted;
  std::cerr << "answered " << answered << " of 1500 pipelined, " << greeted << " of 1500 sequential\n";
}

TEST_F(RdzvSecurity, FifteenHundredConcurrentHandshakesAreAllAnswered) {
  if (!allow_descriptors(4096)) GTEST_SKIP() << "needs 4096 file descriptors (ulimit -Hn is lower)";
  Agent& host = start_agent({"--nnodes", "2", "--rdzv-conf", "join_timeout=20"}, worker());
  ASSERT_TRUE(wait_for_err(host, "hosting the rendezvous store")) << everything();
  // Many connections arrive in one pass of the store's loop, each with its request already sent.
  std::vector<std::unique_ptr<RawPeer>> peers;
  for (int i = 0; i < 1500; ++i) {
    peers.push_back(std::make_unique<RawPeer>(port_));
    peers.back()->send({"HELLO", kProtocol, "ab"});
    if (i % 300 == 299) {
      // Read what came so far: the store may evict the oldest strangers once its table is full.
      for (auto& peer : peers) peer->receive(0ms);
    }
  }
  int greeted = 0;
  for (auto& peer : peers) greeted += peer->greeted(3s) ? 1 : 0;
  EXPECT_EQ(greeted, 1500) << "dropped " << 1500 - greeted;
  std::cerr << "answered " << greeted << " of 1500 concurrent\n";
}

TEST_F(RdzvSecurity, TheStoreUnderValgrindHasNoMemoryErrorsThroughAFloodAndABurst) {
  if (::access("/usr/bin/valgrind", X_OK) != 0) GTEST_SKIP() << "valgrind is not installed (apt-get install valgrind)";
  if (!allow_descriptors(4096)) GTEST_SKIP() << "needs 4096 file descriptors (ulimit -Hn is lower)";
  const std::string file = write_secret("secret", "valgrind-secret-" + ddprun::random_hex(8));
  const std::string log = dir_ + "/valgrind.log";
  Agent& host = start_agent({"--nnodes", "2", "--rdzv-secret-file", file, "--rdzv-conf", "join_timeout=60"}, worker(),
                            {"valgrind", "--error-exitcode=99", "--log-file=" + log});
  ASSERT_TRUE(wait_for_err(host, "hosting the rendezvous store", 30s)) << everything();
  std::vector<int> flood = open_idle_connections(port_, 1300);
  RawPeer burst(port_);
  ASSERT_EQ(burst.authenticate(read_text_file(file).substr(0, read_text_file(file).size() - 1)), (Message{"ok"}));
  std::string requests;
  for (int i = 0; i < 200; ++i) requests += encode({"POLL", "x"});
  burst.send_raw(requests);
  int answered = 0;
  while (answered < 200 && !burst.receive(10s).empty()) ++answered;
  EXPECT_EQ(answered, 200);
  Agent& late = start_agent({"--nnodes", "2", "--rdzv-secret-file", file}, worker());
  EXPECT_TRUE(wait_for_err(late, "rendezvous round 0", 20s)) << everything();
  for (int fd : flood) ::close(fd);
  for (Agent& agent : agents_) EXPECT_EQ(agent.finish(60s).exit_code, 0) << everything() << read_text_file(log);
  EXPECT_NE(read_text_file(log).find("ERROR SUMMARY: 0 errors"), std::string::npos) << read_text_file(log);
}

}  // namespace
