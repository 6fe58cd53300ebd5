#include <ddp/fault_tolerant_hsdp.h>

#include "comm/fnv1a.h"
#include "fault/ft_store.h"
#include "launch/test_seams.h"

#include <ddp/env.h>
#include <ddp/error.h>
#include <ddp/launch_env.h>

#include <torch/nn/module.h>
#include <torch/serialize/archive.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace ddp {
namespace {

int env_int(const char* name, int fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? std::atoi(value) : fallback;
}

// A port the kernel calls free on the loopback now. The shard group's rank 0
// hosts its store there; the moment between closing this socket and binding
// the store's is the only window for another process to take it.
int free_loopback_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  DDP_CHECK(fd >= 0, "ddp: fault-tolerant HSDP could not open a socket to find a free port");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  ::close(fd);
  DDP_CHECK(ok, "ddp: fault-tolerant HSDP found no free port on 127.0.0.1 for its shard group");
  return ntohs(address.sin_port);
}

std::vector<std::string> sorted(std::vector<std::string> ids) {
  std::sort(ids.begin(), ids.end());
  return ids;
}

// The members as a number two replica groups compare: 62 bits, so that its
// negation fits in the same all-reduce (MIN of both is equality).
int64_t members_fingerprint(const std::vector<std::string>& ids) {
  std::string text;
  for (const auto& id : sorted(ids)) text += id + ",";
  return static_cast<int64_t>(detail::fnv1a(text) >> 2);
}

}  // namespace

FaultTolerantHSDPOptions::FaultTolerantHSDPOptions() {
  replica_size_ = std::max(1, env_int("DDP_FT_REPLICA_SIZE", 1));
  shard_index_ = env_int(launch_env::kLocalRank, 0) % replica_size_;
}

FaultTolerantHSDP::FaultTolerantHSDP(FaultTolerantHSDPOptions options)
    : replica_size_(options.replica_size()), shard_index_(options.shard_index()) {
  DDP_CHECK(replica_size_ >= 1 && shard_index_ >= 0 && shard_index_ < replica_size_,
            "ddp: FaultTolerantHSDP needs 0 <= shard_index < replica_size, got shard ", shard_index_, " of ",
            replica_size_, " (ddprun --ft-replica-size S gives DDP_FT_REPLICA_SIZE; the shard is LOCAL_RANK % S)");
  const FaultToleranceOptions& given = options.fault_tolerance();
  group_id_ = given.replica_id();
  store_spec_ = given.store();
  join_timeout_ = given.join_timeout();
  FaultToleranceOptions quorum_options = given;
  DDP_CHECK(quorum_options.fixed_size() == 0, "ddp: FaultTolerantHSDP does not support fixed_size (spares) yet: its ",
            "groups' sampler slices count every group; leave FaultToleranceOptions::fixed_size at 0");
  quorum_options.scope(quorum_options.scope() + "hsdp/shard" + std::to_string(shard_index_) + "/")
      .broadcast_buffers(false);
  quorum_ = std::make_unique<FaultTolerance>(quorum_options);

  World world;  // this replica group's processes, on this host
  world.rank = shard_index_;
  world.local_rank = shard_index_;
  world.world_size = replica_size_;
  world.local_world_size = replica_size_;
  world.master_addr = "127.0.0.1";
  if (replica_size_ > 1) {
    // The group's processes meet through the quorums' store, under a key of
    // this incarnation of the group (its replica id changes on a restart).
    auto store = detail::open_ft_store(quorum_options.store(), quorum_options.join_timeout());
    // Every process of the group is alive and here before its group is made,
    // so the group's rendezvous, under the collectives' timeout, is quick.
    wait_for_the_group("ready");
    const std::string key = "hsdp/group/" + group_id_ + "/port";
    if (shard_index_ == 0) {
      world.master_port = free_loopback_port();
      const std::string port = std::to_string(world.master_port);
      store->set(key, std::vector<uint8_t>(port.begin(), port.end()));
    } else {
      try {
        store->wait({key}, quorum_options.join_timeout());
      } catch (const std::exception& e) {
        DDP_CHECK(false, "ddp: replica group ", group_id_, ": shard 0 of the group never published its shard "
                  "group's address within ", quorum_options.join_timeout().count(), " ms (", e.what(),
                  "); start all ", replica_size_, " processes of the group (ddprun --ft-replica-size does)");
      }
      const auto port = store->get(key);
      world.master_port = std::stoi(std::string(port.begin(), port.end()));
    }
    shard_group_ = ProcessGroup::create(world, ProcessGroupOptions()
                                                   .init_method("env://")
                                                   .timeout(std::max<std::chrono::milliseconds>(
                                                       2 * quorum_options.deadline() + std::chrono::seconds(1),
                                                       std::chrono::seconds(30)))
                                                   .install_stack_dump_handler(false)
                                                   .install_terminate_handler(false));
    if (shard_index_ == 0) store->deleteKey(key);  // every process of the group has connected
  } else {
    shard_group_ = quorum_->local_group();
  }
}

FaultTolerantHSDP::~FaultTolerantHSDP() = default;

void FaultTolerantHSDP::wait_for_the_group(const std::string& what) {
  if (replica_size_ == 1) return;
  auto store = detail::open_ft_store(store_spec_, join_timeout_);
  const std::string key = "hsdp/group/" + group_id_ + "/" + what;
  if (store->add(key, 1) == replica_size_) store->set(key + "/all", std::vector<uint8_t>{'1'});
  try {
    store->wait({key + "/all"}, join_timeout_);
  } catch (const std::exception& e) {
    DDP_CHECK(false, "ddp: replica group ", group_id_, ": not all ", replica_size_, " of its processes reached '",
              what, "' within ", join_timeout_.count(), " ms (", e.what(), "); start all of them (ddprun ",
              "--ft-replica-size does)");
  }
}

FSDPOptions FaultTolerantHSDP::fsdp_options(FSDPOptions base) { return base.replicate_hook(quorum_->comm_hook()); }

void FaultTolerantHSDP::manage_shards(const std::vector<at::Tensor>& shards,
                                      const std::shared_ptr<torch::nn::Module>& root,
                                      torch::optim::Optimizer* optimizer, FaultTolerantSampler* sampler) {
  // One module of this process's shards and the root's buffers: what the
  // quorum heals a joiner with, tensor by tensor, from the processes that
  // hold the same shard.
  managed_ = std::make_shared<torch::nn::Module>("FaultTolerantHSDPShards");
  for (size_t i = 0; i < shards.size(); ++i) {
    managed_->register_parameter("shard" + std::to_string(i), shards[i], shards[i].requires_grad());
  }
  if (root) {
    size_t i = 0;
    for (const auto& buffer : root->buffers(/*recurse=*/true)) managed_->register_buffer("buffer" + std::to_string(i++), buffer);
  }
  quorum_->manage(managed_, optimizer, nullptr);
  // The quorum advances a sampler by its own members; here a step's window
  // has data_size() slices, so the sampler is advanced here and only its
  // position travels with the quorum's state.
  sampler_ = sampler;
  if (sampler_ != nullptr) {
    quorum_->manage_state(
        [this](torch::serialize::OutputArchive& archive) {
          archive.write("hsdp/sampler/epoch", at::scalar_tensor(sampler_->epoch(), at::kLong));
          archive.write("hsdp/sampler/cursor", at::scalar_tensor(sampler_->cursor(), at::kLong));
        },
        [this](torch::serialize::InputArchive& archive) {
          at::Tensor epoch, cursor;
          archive.read("hsdp/sampler/epoch", epoch);
          archive.read("hsdp/sampler/cursor", cursor);
          sampler_->set_position(epoch.item<int64_t>(), cursor.item<int64_t>());
        });
  }
}

void FaultTolerantHSDP::start_step() {
  quorum_->start_step();
  if (!started_) {
    // A first quorum, or a join and its heal, takes each shard's quorum its
    // own time; the group's processes enter their first step together, so
    // that this skew never counts against the group's collectives' timeout.
    wait_for_the_group("first-step");
    started_ = true;
  }
}

bool FaultTolerantHSDP::should_commit() {
  // Every process of the group must reach the same decision; a collective
  // of the group that fails means a sibling is gone, and the group with it.
  auto over_the_group = [&](at::Tensor& values) {
    try {
      shard_group_->all_reduce(values, c10d::ReduceOp::MIN);
    } catch (const std::exception& e) {
      throw FencedOut(c10::str("ddp: replica group ", quorum_->replica_id(), " lost a process (its shard group "
                               "failed: ", e.what(), "), so the group cannot go on and leaves the job as one "
                               "replica. Exit and let ddprun --ft-replica-size restart the whole group; it heals "
                               "from the live groups"));
    }
  };
  if (replica_size_ > 1) {
    // Joiners enter at a step that every shard index's quorum lets them in
    // at: each holds them until all of the group's quorums see one waiting.
    at::Tensor waiting = at::tensor({int64_t{quorum_->join_pending() ? 1 : 0}}, at::kLong);
    over_the_group(waiting);
    quorum_->hold_joiners(waiting.item<int64_t>() == 0);
  }
  if (const auto& seam = detail::test_seams().ft_hsdp_before_vote) seam();
  const bool committed = quorum_->should_commit();
  bool apply = committed;
  if (replica_size_ > 1) {
    const int64_t members = members_fingerprint(quorum_->members());
    at::Tensor votes = at::tensor({int64_t{committed ? 1 : 0}, members, -members}, at::kLong);
    over_the_group(votes);
    const bool all_committed = votes[0].item<int64_t>() == 1;
    const bool same_members = votes[1].item<int64_t>() == -votes[2].item<int64_t>();
    apply = all_committed && same_members;
    if (committed && !apply) {
      quorum_->skip_committed_step(all_committed ? "the quorums of this replica group's shards have other members"
                                                 : "another shard's quorum skipped the step");
    }
    // A failure's new groups take no joiners: they enter every quorum at a commit.
    if (!apply) quorum_->hold_joiners(true);
  }
  if (apply && sampler_ != nullptr) sampler_->advance(data_size());
  return apply;
}

int FaultTolerantHSDP::replica_rank() const {
  const auto ids = sorted(quorum_->members());
  const auto it = std::find(ids.begin(), ids.end(), quorum_->replica_id());
  return it == ids.end() ? -1 : static_cast<int>(it - ids.begin());
}

int FaultTolerantHSDP::replicas() const { return quorum_->size(); }
int FaultTolerantHSDP::data_rank() const { return replica_rank() * replica_size_ + shard_index_; }
int FaultTolerantHSDP::data_size() const { return replicas() * replica_size_; }

}  // namespace ddp
