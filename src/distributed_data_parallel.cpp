#include <ddp/distributed_data_parallel.h>

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <map>
#include <sstream>

namespace ddp {
namespace detail {
namespace {

struct TensorSignature {
  std::string kind;  // "parameter" or "buffer"
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;

  std::string encode() const {
    std::ostringstream out;
    out << kind << '\t' << name << '\t' << dtype << '\t';
    for (int64_t d : shape) out << d << ',';
    return out.str();
  }
  static TensorSignature decode(const std::string& line) {
    TensorSignature s;
    std::istringstream in(line);
    std::getline(in, s.kind, '\t');
    std::getline(in, s.name, '\t');
    std::getline(in, s.dtype, '\t');
    std::string dims;
    std::getline(in, dims, '\t');
    std::istringstream dim_in(dims);
    std::string d;
    while (std::getline(dim_in, d, ',')) s.shape.push_back(std::stoll(d));
    return s;
  }
  std::string shape_text() const { return c10::str(c10::IntArrayRef(shape)); }
};

std::vector<TensorSignature> signatures_of(const torch::nn::Module& module) {
  std::vector<TensorSignature> result;
  for (const auto& item : module.named_parameters(true)) {
    const at::Tensor& t = item.value();
    // A frozen parameter on one rank only would give ranks different buckets.
    std::string dtype = "(" + std::string(c10::toString(t.scalar_type())) + ", " +
                        (t.requires_grad() ? "trainable" : "frozen") + ", " +
                        c10::DeviceTypeName(t.device().type(), /*lower_case=*/true) + ")";
    result.push_back({"parameter", item.key(), dtype, t.sizes().vec()});
  }
  for (const auto& item : module.named_buffers(true)) {
    const at::Tensor& t = item.value();
    result.push_back({"buffer", item.key(), std::string(c10::toString(t.scalar_type())), t.sizes().vec()});
  }
  return result;
}

std::string encode_all(const std::vector<TensorSignature>& signatures) {
  std::string text;
  for (const auto& s : signatures) text += s.encode() + "\n";
  return text;
}

std::vector<TensorSignature> decode_all(const std::string& text) {
  std::vector<TensorSignature> result;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) result.push_back(TensorSignature::decode(line));
  return result;
}

uint64_t fnv1a(const std::string& text) {
  uint64_t hash = 1469598103934665603ULL;
  for (unsigned char c : text) {
    hash ^= c;
    hash *= 1099511628211ULL;
  }
  return hash;
}

// Why rank `other` differs from rank 0, naming the first differing tensor.
std::string describe_difference(const std::vector<TensorSignature>& root, int other,
                                const std::vector<TensorSignature>& theirs) {
  std::ostringstream why;
  size_t n = std::min(root.size(), theirs.size());
  for (size_t i = 0; i < n; ++i) {
    const auto& a = root[i];
    const auto& b = theirs[i];
    if (a.kind != b.kind || a.name != b.name) {
      why << a.kind << " #" << i << " is '" << a.name << "' on rank 0 but " << b.kind << " '" << b.name
          << "' on rank " << other;
      return why.str();
    }
    if (a.shape != b.shape) {
      why << a.kind << " '" << a.name << "' has shape " << a.shape_text() << " on rank 0 but "
          << b.shape_text() << " on rank " << other;
      return why.str();
    }
    if (a.dtype != b.dtype) {
      why << a.kind << " '" << a.name << "' is " << a.dtype << " on rank 0 but " << b.dtype
          << " on rank " << other;
      return why.str();
    }
  }
  const auto& longer = root.size() > theirs.size() ? root : theirs;
  int longer_rank = root.size() > theirs.size() ? 0 : other;
  why << "rank 0 has " << root.size() << " parameters and buffers but rank " << other << " has "
      << theirs.size() << "; the first extra one is " << longer[n].kind << " '" << longer[n].name
      << "' on rank " << longer_rank;
  return why.str();
}

std::vector<uint8_t> to_bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

}  // namespace

void verify_replicas_match(const torch::nn::Module& module, ProcessGroup& group) {
  if (group.size() == 1) return;
  std::string prefix = group.unique_store_prefix("replica_check");

  auto mine = signatures_of(module);
  std::string encoded = encode_all(mine);
  group.store().set(prefix + std::to_string(group.rank()), to_bytes(encoded));

  at::Tensor hash = at::empty({1}, group.control_options().dtype(at::kLong));
  hash.fill_(static_cast<int64_t>(fnv1a(encoded)));
  auto hashes = group.all_gather(hash);
  std::vector<int> differing;
  for (int r = 1; r < group.size(); ++r) {
    if (hashes[r].item<int64_t>() != hashes[0].item<int64_t>()) differing.push_back(r);
  }
  if (differing.empty()) return;

  auto fetch = [&](int rank) {
    auto bytes = group.store().get(prefix + std::to_string(rank));
    return decode_all(std::string(bytes.begin(), bytes.end()));
  };
  auto root = fetch(0);
  int other = differing.front();
  TORCH_CHECK(false, "ddp: DistributedDataParallel needs the same model on every rank, but ",
              describe_difference(root, other, fetch(other)), " (", differing.size(),
              " rank(s) differ from rank 0). Build the model identically on every rank.");
}

void broadcast_module_state(torch::nn::Module& module, ProcessGroup& group, bool parameters,
                            bool buffers, int root) {
  if (group.size() == 1) return;
  std::vector<at::Tensor> tensors;
  if (parameters) {
    for (auto& p : module.parameters(true)) tensors.push_back(p);
  }
  if (buffers) {
    for (auto& b : module.buffers(true)) tensors.push_back(b);
  }
  // One broadcast per dtype and device instead of one per tensor.
  std::map<std::pair<int, std::string>, std::vector<at::Tensor>> groups;
  for (auto& t : tensors) {
    groups[{static_cast<int>(t.scalar_type()), t.device().str()}].push_back(t);
  }
  at::NoGradGuard no_grad;
  for (auto& [key, members] : groups) {
    std::vector<at::Tensor> flat_views;
    for (auto& t : members) flat_views.push_back(t.reshape({-1}));
    at::Tensor flat = at::cat(flat_views);
    group.broadcast(flat, root);
    int64_t offset = 0;
    for (auto& t : members) {
      t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

DataParallelCore::DataParallelCore(std::shared_ptr<torch::nn::Module> module,
                                   std::shared_ptr<ProcessGroup> group, DDPOptions options)
    : module_(std::move(module)), group_(std::move(group)), options_(options) {
  TORCH_CHECK(module_, "ddp: DistributedDataParallel got a null module");
  TORCH_CHECK(group_, "ddp: DistributedDataParallel got a null process group");
  verify_replicas_match(*module_, *group_);
  broadcast_module_state(*module_, *group_, /*parameters=*/true, /*buffers=*/true);
  has_buffers_ = !module_->buffers(true).empty();

  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  for (const auto& item : module_->named_parameters(true)) {
    if (!item.value().requires_grad()) continue;
    params.push_back(item.value());
    names.push_back(item.key());
  }
  reducer_ = std::make_unique<GradientReducer>(std::move(params), std::move(names), group_,
                                               options_.reducer_options());
}

void DataParallelCore::before_forward() {
  reducer_->prepare_for_forward();
  if (options_.broadcast_buffers() && has_buffers_) {
    broadcast_module_state(*module_, *group_, /*parameters=*/false, /*buffers=*/true);
  }
}

void DataParallelCore::after_forward(const std::vector<at::Tensor>& outputs) {
  reducer_->prepare_for_backward(outputs);
}

void DataParallelCore::shadow_step() {
  before_forward();
  reducer_->shadow_backward();
}

}  // namespace detail

int Join::step() {
  TORCH_CHECK(!finished_, "ddp: Join::step() after finish()");
  at::Tensor active = at::ones({1}, group_.control_options().dtype(at::kInt));
  group_.all_reduce(active);
  ++steps_;
  return active.item<int>();
}

void Join::finish() {
  TORCH_CHECK(!finished_, "ddp: Join::finish() called twice");
  finished_ = true;
  while (true) {
    at::Tensor active = at::zeros({1}, group_.control_options().dtype(at::kInt));
    group_.all_reduce(active);
    if (active.item<int>() == 0) break;
    core_.shadow_step();
    ++shadowed_;
  }
  // The rank that trained longest holds the weights every step touched;
  // the highest such rank is the source for all.
  at::Tensor longest = at::full({1}, steps_, group_.control_options().dtype(at::kLong));
  group_.all_reduce(longest, c10d::ReduceOp::MAX);
  at::Tensor source = at::full({1}, steps_ == longest.item<int64_t>() ? group_.rank() : -1,
                               group_.control_options().dtype(at::kLong));
  group_.all_reduce(source, c10d::ReduceOp::MAX);
  detail::broadcast_module_state(core_.module(), group_, /*parameters=*/true, /*buffers=*/true,
                                 static_cast<int>(source.item<int64_t>()));
}
}  // namespace ddp
