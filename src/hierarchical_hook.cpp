// Hierarchical all-reduce as a DDP communication hook: reduce each bucket to
// the node's first rank, all-reduce between those leaders, broadcast back in
// the node. Only the leaders' all-reduce crosses between nodes, and it moves
// one bucket per node instead of one per rank.
//
// The three steps depend on each other, so they run one after the other on
// a thread of the hook's own. Buckets reach it in launch order, which is the
// same on every rank, and it takes them first in, first out, so every rank
// issues the same collectives on the same groups in the same order, while
// the autograd thread goes on with the rest of backward (overlap is kept).

#include <ddp/comm_hooks.h>
#include <ddp/device_mesh.h>
#include <ddp/error.h>

#include <ATen/core/ivalue.h>

#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <string>
#include <thread>

namespace ddp {
namespace {

class HierarchicalAllreduceHook : public CommHook {
 public:
  explicit HierarchicalAllreduceHook(const DeviceMesh& mesh)
      : node_(mesh.group(mesh.ndim() - 1)),
        leaders_(mesh.ndim() == 2 && mesh.coordinate(mesh.dim_names()[1]) == 0 ? mesh.group(0) : nullptr),
        mesh_size_(mesh.process_group()->size()),
        worker_([this] { work(); }) {}

  ~HierarchicalAllreduceHook() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    ready_.notify_all();
    worker_.join();
  }

  c10::intrusive_ptr<c10::ivalue::Future> run(ProcessGroup& group, GradBucket& bucket) override {
    DDP_CHECK(!bucket.scatters(), "ddp: hierarchical_allreduce_hook all-reduces DDP's buckets; FSDP reduce-scatters "
              "into shards, so give FSDP a 2-D DeviceMesh (HSDP) instead");
    DDP_CHECK(group.size() == mesh_size_, "ddp: hierarchical_allreduce_hook was built over a mesh of ", mesh_size_,
              " ranks but DDP's group has ", group.size(), "; build the mesh over DDP's own group");
    auto future = bucket.buffer().is_cpu()
                      ? c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get())
                      : c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get(),
                                                                 std::vector<c10::Device>{bucket.buffer().device()});
    {
      std::lock_guard<std::mutex> lock(mutex_);
      jobs_.push_back(Job{bucket.buffer(), bucket.index(), future});
    }
    ready_.notify_one();
    return future;
  }

 private:
  struct Job {
    at::Tensor buffer;
    size_t index;
    c10::intrusive_ptr<c10::ivalue::Future> done;
  };

  void work() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      try {
        CollectiveTag tag("ddp bucket " + std::to_string(job.index) + " hierarchical all-reduce");
        if (node_->size() > 1) node_->reduce(job.buffer, /*root=*/0);
        if (leaders_ && leaders_->size() > 1) leaders_->all_reduce(job.buffer);
        if (node_->size() > 1) node_->broadcast(job.buffer, /*root=*/0);
        job.done->markCompleted(job.buffer);
      } catch (...) {
        job.done->setError(std::current_exception());
      }
    }
  }

  std::shared_ptr<ProcessGroup> node_;     // this rank's node: the mesh's last dimension
  std::shared_ptr<ProcessGroup> leaders_;  // the nodes' first ranks; null on the other ranks
  int mesh_size_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<Job> jobs_;
  bool stopping_ = false;
  std::thread worker_;  // last: it starts in the constructor and uses the members above
};

}  // namespace

std::shared_ptr<CommHook> hierarchical_allreduce_hook(const DeviceMesh& mesh) {
  return std::make_shared<HierarchicalAllreduceHook>(mesh);
}

}  // namespace ddp
