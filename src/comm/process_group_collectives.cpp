// ProcessGroup's collectives beyond those DDP and FSDP need (reduce, the
// blocking reduce_scatter, gather, scatter, all_to_all, batch_isend_irecv,
// monitored_barrier and the object collectives), each traced through enter() and track() like the ones in
// process_group.cpp. The mpi backend's side of them is in backend_mpi.cpp.

#include <ddp/process_group.h>

#include <ddp/checkpoint.h>
#include <ddp/error.h>

#include "comm/backends.h"
#include "common/duration_text.h"
#include "comm/process_group_impl.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace ddp {
namespace {

using detail::seconds_text;
using Clock = std::chrono::steady_clock;

void check_group_rank(const ProcessGroup& group, const char* op, const char* role, int rank) {
  DDP_CHECK(rank >= 0 && rank < group.size(), "ddp: ", op, " was given ", role, " ", rank, ", but process group ",
            group.name(), " has ranks 0 to ", group.size() - 1,
            ". Pass a rank of this group (in a subgroup, group_rank_of(global_rank) gives it).");
}

// The rows of `tensor` that go to (or come from) each rank: `splits`, or
// equal parts when empty. Throws, saying what to pass, when they do not add up.
void check_splits(const ProcessGroup& group, const char* which, const at::Tensor& tensor,
                  const std::vector<int64_t>& splits) {
  DDP_CHECK(tensor.dim() >= 1, "ddp: all_to_all's ", which, " must have at least one dimension (its rows are ",
            "split among the ranks); got a tensor of shape ", tensor.sizes());
  const int64_t rows = tensor.size(0);
  if (splits.empty()) {
    DDP_CHECK(rows % group.size() == 0, "ddp: all_to_all's ", which, " has ", rows, " rows, which do not split ",
              "evenly among ", group.size(), " ranks; pass ", which, "_split_sizes");
    return;
  }
  DDP_CHECK(static_cast<int>(splits.size()) == group.size(), "ddp: all_to_all's ", which, "_split_sizes has ",
            splits.size(), " entries; it needs one per rank (", group.size(), ")");
  int64_t total = 0;
  for (int64_t s : splits) {
    DDP_CHECK(s >= 0, "ddp: all_to_all's ", which, "_split_sizes has a negative entry (", s, ")");
    total += s;
  }
  DDP_CHECK(total == rows, "ddp: all_to_all's ", which, "_split_sizes add up to ", total, " rows but the ", which,
            " has ", rows, "; they must add up to its first dimension");
}

// "rank 2" or "ranks 1, 2", as monitored_barrier's errors name them.
std::string ranks_named(const std::vector<int>& global_ranks) {
  std::string text = global_ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < global_ranks.size(); ++i) text += (i ? ", " : "") + std::to_string(global_ranks[i]);
  return text;
}

std::string text_of(const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }
std::vector<uint8_t> bytes_of(const std::string& text) { return std::vector<uint8_t>(text.begin(), text.end()); }

// "1,2" <-> {1, 2}: the verdict rank 0 leaves in the store.
std::string join_ranks(const std::vector<int>& ranks) {
  std::string text;
  for (size_t i = 0; i < ranks.size(); ++i) text += (i ? "," : "") + std::to_string(ranks[i]);
  return text;
}
std::vector<int> split_ranks(const std::string& text) {
  std::vector<int> ranks;
  size_t start = 0;
  while (start < text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string::npos) comma = text.size();
    ranks.push_back(std::stoi(text.substr(start, comma - start)));
    start = comma + 1;
  }
  return ranks;
}

// How long the ranks other than 0 wait for rank 0's verdict beyond the
// timeout: rank 0 may have entered the barrier after them.
std::chrono::milliseconds verdict_grace(std::chrono::milliseconds timeout) {
  return std::min<std::chrono::milliseconds>(timeout, std::chrono::seconds(5));
}

const std::chrono::milliseconds kStorePoll(5);

std::vector<char> chars_of(const at::Tensor& bytes, int64_t size) {
  at::Tensor cpu = bytes.cpu().contiguous();
  const char* begin = static_cast<const char*>(cpu.data_ptr());
  return std::vector<char>(begin, begin + size);
}

at::Tensor tensor_of(const std::vector<char>& bytes, int64_t padded_size) {
  at::Tensor tensor = at::zeros({padded_size}, at::TensorOptions().dtype(at::kByte));
  if (!bytes.empty()) std::memcpy(tensor.data_ptr(), bytes.data(), bytes.size());
  return tensor;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroup::reduce_async(at::Tensor& tensor, int root, c10d::ReduceOp op) {
  require_usable("reduce");
  check_group_rank(*this, "reduce", "root", root);
  const uint64_t seq = enter("reduce", tensor);
  std::vector<at::Tensor> tensors{tensor};
  c10d::ReduceOptions opts;
  opts.reduceOp = op;
  opts.rootRank = root;
  opts.timeout = impl_->options_.timeout();
  return track(seq, impl_->backend_->reduce(tensors, opts));
}

void ProcessGroup::reduce(at::Tensor& tensor, int root, c10d::ReduceOp op) {
  require_usable("reduce");
  check_group_rank(*this, "reduce", "root", root);
  const uint64_t seq = enter("reduce", tensor);
  std::vector<at::Tensor> tensors{tensor};
  c10d::ReduceOptions opts;
  opts.reduceOp = op;
  opts.rootRank = root;
  opts.timeout = impl_->options_.timeout();
  opts.asyncOp = impl_->async_op_when_waited();
  wait(track(seq, impl_->backend_->reduce(tensors, opts)), "reduce");
}

// The asynchronous form is in process_group.cpp with all_gather_into_async,
// since both route Gloo CPU tensors to the rings.
void ProcessGroup::reduce_scatter(at::Tensor& output, at::Tensor& input, c10d::ReduceOp op) {
  wait(reduce_scatter_async(output, input, op), "reduce_scatter");
}

std::vector<at::Tensor> ProcessGroup::gather(const at::Tensor& input, int root) {
  require_usable("gather");
  check_group_rank(*this, "gather", "root", root);
  std::vector<at::Tensor> inputs{input.contiguous()};
  // Backends take the root's list of outputs, and no list elsewhere.
  std::vector<std::vector<at::Tensor>> outputs;
  if (rank() == root) {
    outputs.emplace_back();
    for (int r = 0; r < size(); ++r) outputs[0].push_back(at::empty_like(inputs[0]));
  }
  c10d::GatherOptions opts;
  opts.rootRank = root;
  opts.timeout = impl_->options_.timeout();
  const uint64_t seq = enter("gather", inputs[0]);
  wait(track(seq, impl_->backend_->gather(outputs, inputs, opts)), "gather");
  return rank() == root ? outputs[0] : std::vector<at::Tensor>{};
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::scatter_async(at::Tensor& output, const std::vector<at::Tensor>& inputs,
                                                           int root) {
  require_usable("scatter");
  check_group_rank(*this, "scatter", "root", root);
  DDP_CHECK(output.is_contiguous(), "ddp: scatter receives into a contiguous output; pass output.contiguous() ",
            "and read the result from it");
  std::vector<std::vector<at::Tensor>> sources;
  if (rank() == root) {
    DDP_CHECK(static_cast<int>(inputs.size()) == size(), "ddp: scatter's root (rank ", root, ") needs one input ",
              "per rank, ", size(), " in all; got ", inputs.size());
    sources.emplace_back();
    for (size_t r = 0; r < inputs.size(); ++r) {
      DDP_CHECK(inputs[r].sizes() == output.sizes() && inputs[r].scalar_type() == output.scalar_type(),
                "ddp: scatter's input ", r, " is ", inputs[r].scalar_type(), " ", inputs[r].sizes(),
                " but the output is ", output.scalar_type(), " ", output.sizes(), "; they must match");
      sources[0].push_back(inputs[r].contiguous());
    }
  } else {
    DDP_CHECK(inputs.empty(), "ddp: scatter takes inputs only on its root (rank ", root, "); rank ", rank(),
              " passed ", inputs.size(), ". Pass {} on the other ranks, as torch.distributed.scatter takes None.");
  }
  std::vector<at::Tensor> outputs{output};
  c10d::ScatterOptions opts;
  opts.rootRank = root;
  opts.timeout = impl_->options_.timeout();
  const uint64_t seq = enter("scatter", output);
  return track(seq, impl_->backend_->scatter(outputs, sources, opts));
}

void ProcessGroup::scatter(at::Tensor& output, const std::vector<at::Tensor>& inputs, int root) {
  wait(scatter_async(output, inputs, root), "scatter");
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::all_to_all_async(at::Tensor& output, at::Tensor& input,
                                                              std::vector<int64_t> output_split_sizes,
                                                              std::vector<int64_t> input_split_sizes) {
  require_usable("all_to_all");
  check_splits(*this, "input", input, input_split_sizes);
  check_splits(*this, "output", output, output_split_sizes);
  DDP_CHECK(input.scalar_type() == output.scalar_type() && input.sizes().slice(1) == output.sizes().slice(1),
            "ddp: all_to_all's input (", input.scalar_type(), " ", input.sizes(), ") and output (",
            output.scalar_type(), " ", output.sizes(), ") must have the same dtype and the same shape after ",
            "dimension 0");
  DDP_CHECK(input.is_contiguous() && output.is_contiguous(), "ddp: all_to_all needs contiguous tensors; pass ",
            ".contiguous() ones");
  // The ranks' row counts differ with uneven splits: the trace and the
  // desync check see one row, whose dtype and shape every rank shares.
  at::Tensor row = at::empty(input.sizes().slice(1), input.options().device(at::kMeta));
  c10d::AllToAllOptions opts;
  opts.timeout = impl_->options_.timeout();
  const uint64_t seq = enter("all_to_all", row);
  return track(seq, impl_->backend_->alltoall_base(output, input, output_split_sizes, input_split_sizes, opts));
}

void ProcessGroup::all_to_all(at::Tensor& output, at::Tensor& input, std::vector<int64_t> output_split_sizes,
                              std::vector<int64_t> input_split_sizes) {
  wait(all_to_all_async(output, input, std::move(output_split_sizes), std::move(input_split_sizes)), "all_to_all");
}

std::vector<c10::intrusive_ptr<c10d::Work>> ProcessGroup::batch_isend_irecv(std::vector<P2POp> ops) {
  require_usable("batch_isend_irecv");
  DDP_CHECK(!ops.empty(), "ddp: batch_isend_irecv needs at least one P2POp");
  for (size_t i = 0; i < ops.size(); ++i) {
    DDP_CHECK(ops[i].tensor.defined(), "ddp: batch_isend_irecv's op ", i, " has no tensor");
    check_group_rank(*this, "batch_isend_irecv", "peer", ops[i].peer);
    DDP_CHECK(ops[i].peer != rank(), "ddp: batch_isend_irecv's op ", i, " names this rank (", rank(),
              ") as its peer; a rank cannot send to itself");
  }
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  CollectiveTag tag("batch_isend_irecv");
  for (P2POp& op : ops) {
    works.push_back(op.kind == P2POp::kIsend ? send_async(op.tensor, op.peer, op.tag)
                                             : recv_async(op.tensor, op.peer, op.tag));
  }
  return works;
}

void ProcessGroup::monitored_barrier(std::optional<std::chrono::milliseconds> timeout_or_default,
                                     bool wait_all_ranks) {
  require_usable("monitored_barrier");
  const std::chrono::milliseconds timeout = timeout_or_default.value_or(impl_->options_.timeout());
  DDP_CHECK(timeout.count() > 0, "ddp: monitored_barrier's timeout must be positive; got ", timeout.count(), " ms");
  const int64_t call = impl_->monitored_barriers_++;
  // Every rank makes the same store prefix calls in the same order.
  const std::string prefix = impl_->backend_kind_ == BackendKind::kMpi ? "" : unique_store_prefix("monitored_barrier");
  const uint64_t seq = enter("monitored_barrier", at::Tensor());
  const Clock::time_point start = Clock::now();
  const auto waited = [&] {
    return seconds_text(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start));
  };
  const auto end_trace = [&](bool ok) {
    if (seq != 0) impl_->trace_->end(seq, ok);
  };
  if (size() == 1) {
    end_trace(true);
    return;
  }
  const std::string after =
      " A rank named may be hung, slow or dead (its stacks: kill -USR1 <pid>; its trace: DDP_TRACE_DIR). "
      "A rank that missed a monitored_barrier is one call behind the others: continue on a new group.";
  try {
    // Rank 0 finds the missing ranks (group ranks); the others learn them
    // from its verdict, or learn nothing if none came.
    std::optional<std::vector<int>> missing;
    if (impl_->backend_kind_ == BackendKind::kMpi) {
      missing = detail::mpi_monitored_barrier(impl_->backend_, call, start + timeout,
                                              start + timeout + verdict_grace(timeout), wait_all_ranks);
    } else if (rank() == 0) {
      std::vector<int> waiting;
      std::vector<std::string> keys;
      for (int r = 1; r < size(); ++r) {
        waiting.push_back(r);
        keys.push_back(prefix + "arrived/" + std::to_string(r));
      }
      // One question a poll while some are missing; each key on its own
      // only once the deadline has come, to learn which.
      const Clock::time_point deadline = start + timeout;
      bool all = impl_->store_->check(keys);
      while (!all && Clock::now() < deadline) {
        std::this_thread::sleep_for(kStorePoll);
        all = impl_->store_->check(keys);
      }
      if (all) waiting.clear();
      std::vector<int> still;
      for (int r : waiting) {
        if (!impl_->store_->check({keys[r - 1]})) still.push_back(r);
      }
      waiting = std::move(still);
      std::vector<std::string> read_keys;  // of the ranks that arrived
      for (int r = 1; r < size(); ++r) {
        if (std::find(waiting.begin(), waiting.end(), r) == waiting.end()) {
          read_keys.push_back(prefix + "read/" + std::to_string(r));
        }
      }
      // As torch's: the first rank that did not arrive, or all of them.
      if (!waiting.empty() && !wait_all_ranks) waiting.resize(1);
      missing = waiting;
      impl_->store_->set(prefix + "verdict",
                         bytes_of(waiting.empty() ? std::string("ok") : "missing:" + join_ranks(waiting)));
      for (int r = 1; r < size(); ++r) impl_->store_->deleteKey(prefix + "arrived/" + std::to_string(r));
      // The ranks that arrived read the verdict before rank 0 goes on: rank 0
      // may host the store, and a program that ends right after this call
      // would otherwise take the store away from a rank still reading it.
      const Clock::time_point read_by = Clock::now() + verdict_grace(timeout);
      while (!read_keys.empty() && !impl_->store_->check(read_keys) && Clock::now() < read_by) {
        std::this_thread::sleep_for(kStorePoll);
      }
      for (const auto& key : read_keys) impl_->store_->deleteKey(key);
    } else {
      impl_->store_->set(prefix + "arrived/" + std::to_string(rank()), bytes_of("1"));
      const Clock::time_point deadline = start + timeout + verdict_grace(timeout);
      const std::string key = prefix + "verdict";
      while (!impl_->store_->check({key}) && Clock::now() < deadline) std::this_thread::sleep_for(kStorePoll);
      if (impl_->store_->check({key})) {
        const std::string verdict = text_of(impl_->store_->get(key));
        impl_->store_->set(prefix + "read/" + std::to_string(rank()), bytes_of("1"));
        missing = verdict == "ok" ? std::vector<int>{} : split_ranks(verdict.substr(std::strlen("missing:")));
      }
    }
    if (!missing) {
      DDP_PEER_CHECK(false, "ddp: monitored_barrier on ", where_am_i(), ": this rank arrived, but rank 0 of the ",
                     "group (", rank_label(0), ") gave no verdict within ", waited(), " (the timeout ",
                     seconds_text(timeout), " and a grace of ", seconds_text(verdict_grace(timeout)),
                     "); it has not reached monitored_barrier, or it died.");
    }
    if (!missing->empty()) {
      std::vector<int> global;
      for (int r : *missing) global.push_back(global_rank_of(r));
      DDP_PEER_CHECK(false, "ddp: monitored_barrier failed on ", where_am_i(), ": ", ranks_named(global),
                     " did not reach it within ", seconds_text(timeout),
                     wait_all_ranks ? "" : " (the first missing rank; wait_all_ranks=true names every one)",
                     rank() == 0 ? "." : ", says rank 0 of the group.", after);
    }
  } catch (...) {
    end_trace(false);
    throw;
  }
  end_trace(true);
}

void ProcessGroup::broadcast_as(const char* op, at::Tensor& tensor, int root) {
  const uint64_t seq = enter(op, tensor);
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  opts.timeout = impl_->options_.timeout();
  wait(track(seq, impl_->backend_->broadcast(tensors, opts)), op);
}

void ProcessGroup::broadcast_object(c10::IValue& value, int root) {
  require_usable("broadcast_object");
  check_group_rank(*this, "broadcast_object", "root", root);
  std::vector<char> bytes;
  if (rank() == root) bytes = serialize_value(value);
  at::Tensor length = to_control(at::tensor({static_cast<int64_t>(bytes.size())}, at::kLong));
  broadcast_as("broadcast_object", length, root);
  const int64_t size = length.cpu().item<int64_t>();
  DDP_CHECK(size > 0, "ddp: broadcast_object received a size of ", size, " from ", rank_label(root),
            "; the ranks are out of step");
  at::Tensor payload = to_control(rank() == root ? tensor_of(bytes, size) : at::empty({size}, at::kByte));
  broadcast_as("broadcast_object", payload, root);
  if (rank() != root) {
    value = deserialize_value(chars_of(payload, size), "broadcast_object's value from " + rank_label(root));
  }
}

std::vector<c10::IValue> ProcessGroup::all_gather_object(const c10::IValue& value) {
  require_usable("all_gather_object");
  const std::vector<char> bytes = serialize_value(value);
  std::vector<at::Tensor> lengths =
      all_gather_as("all_gather_object", to_control(at::tensor({static_cast<int64_t>(bytes.size())}, at::kLong)));
  std::vector<int64_t> sizes;
  for (const at::Tensor& t : lengths) sizes.push_back(t.cpu().item<int64_t>());
  const int64_t longest = *std::max_element(sizes.begin(), sizes.end());
  std::vector<at::Tensor> payloads = all_gather_as("all_gather_object", to_control(tensor_of(bytes, longest)));
  std::vector<c10::IValue> values;
  for (int r = 0; r < size(); ++r) {
    DDP_CHECK(sizes[r] > 0 && sizes[r] <= longest, "ddp: all_gather_object got a size of ", sizes[r], " from ",
              rank_label(r), "; the ranks are out of step");
    values.push_back(deserialize_value(chars_of(payloads[r], sizes[r]),
                                       "all_gather_object's value from " + rank_label(r)));
  }
  return values;
}

}  // namespace ddp
