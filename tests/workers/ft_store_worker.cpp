// A worker for ddprun --fault-tolerance's tests (tests/test_ddprun_fault_tolerance.cpp): it
// opens the store ddprun names in DDP_FT_STORE through ddp's own open_ft_store (so the store
// keeper, or the etcd cluster, serves a real c10d client), counts itself in, and ends as asked.
//
//   ft_store_worker --dir DIR [--fail-rank R CODE] [--finish-after SECONDS]
//
// It prints "ft-env KEY=VALUE ..." (the DDP_FT_* variables), adds 1 to the store's key
// "joined", writes its pid to DIR/pid.<RANK>.<INCARNATION> (the incarnation is the number after
// "/inc" in DDP_FT_REPLICA_ID), then: with --fail-rank R CODE, exits CODE at once if it is rank
// R; else waits until DIR/finish exists (or --finish-after seconds pass), prints
// "rank R replica ID sees joined=N" with the store's count at that moment, and exits 0.
#include "fault/ft_store.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

namespace {

std::string env(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? "<unset>" : value;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir;
  int fail_rank = -1;
  int fail_code = 0;
  double finish_after = 60;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--dir" && i + 1 < argc) {
      dir = argv[++i];
    } else if (flag == "--fail-rank" && i + 2 < argc) {
      fail_rank = std::atoi(argv[++i]);
      fail_code = std::atoi(argv[++i]);
    } else if (flag == "--finish-after" && i + 1 < argc) {
      finish_after = std::atof(argv[++i]);
    } else {
      std::fprintf(stderr, "ft_store_worker: bad argument '%s'\n", flag.c_str());
      return 64;
    }
  }
  const int rank = std::atoi(env("RANK").c_str());
  const std::string replica = env("DDP_FT_REPLICA_ID");
  std::printf("ft-env RANK=%d DDP_FAULT_TOLERANCE=%s DDP_FT_STORE=%s DDP_FT_REPLICA_ID=%s DDP_FT_INITIAL_REPLICAS=%s "
              "DDP_FT_DEADLINE_MS=%s\n",
              rank, env("DDP_FAULT_TOLERANCE").c_str(), env("DDP_FT_STORE").c_str(), replica.c_str(),
              env("DDP_FT_INITIAL_REPLICAS").c_str(), env("DDP_FT_DEADLINE_MS").c_str());
  std::fflush(stdout);
  auto store = ddp::detail::open_ft_store(env("DDP_FT_STORE"), std::chrono::seconds(20));
  store->add("joined", 1);
  const size_t inc = replica.rfind("/inc");
  const std::string incarnation = inc == std::string::npos ? "0" : replica.substr(inc + 4);
  {
    const std::string path = dir + "/pid." + std::to_string(rank) + "." + incarnation;
    std::ofstream(path + ".tmp") << ::getpid() << "\n";
    std::rename((path + ".tmp").c_str(), path.c_str());
  }
  if (rank == fail_rank) {
    std::fprintf(stderr, "error: rank %d fails at step 7 as asked\n", rank);
    return fail_code;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(finish_after);
  while (::access((dir + "/finish").c_str(), F_OK) != 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const int64_t joined = store->add("joined", 0);
  std::printf("rank %d replica %s sees joined=%lld\n", rank, replica.c_str(), static_cast<long long>(joined));
  return 0;
}
