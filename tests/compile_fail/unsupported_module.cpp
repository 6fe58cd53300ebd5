// Must not compile: DistributedDataParallel of a type that is no LibTorch
// module. The test (tests/CMakeLists.txt) checks the compiler's message names
// the supported kinds.
#include <ddp/distributed_data_parallel.h>

struct NotAModule {
  int forward(int x) { return x; }
};

void wrap(std::shared_ptr<ddp::ProcessGroup> group) {
  ddp::DistributedDataParallel<NotAModule> model(NotAModule{}, group);
}
