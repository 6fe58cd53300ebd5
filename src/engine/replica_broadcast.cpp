// The replica check and the broadcast of module state (see
// include/ddp/detail/replica_broadcast.h).

#include <ddp/detail/replica_broadcast.h>

#include <ddp/error.h>

#include "comm/fnv1a.h"

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/nn/modules/embedding.h>

#include <cstring>
#include <map>
#include <sstream>

namespace ddp::detail {
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

std::vector<TensorSignature> signatures_of(const ModuleTensors& module) {
  std::vector<TensorSignature> result;
  for (const auto& [name, t] : module.named_parameters()) {
    // A frozen parameter on one rank only would give ranks different buckets.
    std::string dtype = "(" + std::string(c10::toString(t.scalar_type())) + ", " +
                        (t.requires_grad() ? "trainable" : "frozen") + ", " +
                        c10::DeviceTypeName(t.device().type(), /*lower_case=*/true) + ")";
    result.push_back({"parameter", name, dtype, t.sizes().vec()});
  }
  for (const auto& [name, t] : module.named_buffers()) {
    result.push_back({"buffer", name, std::string(c10::toString(t.scalar_type())), t.sizes().vec()});
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


class NativeModuleTensors : public ModuleTensors {
 public:
  explicit NativeModuleTensors(std::shared_ptr<torch::nn::Module> module)
      : owner_(std::move(module)), module_(owner_.get()) {}
  // A view that does not own the module, for the duration of one call.
  explicit NativeModuleTensors(const torch::nn::Module& module)
      : module_(const_cast<torch::nn::Module*>(&module)) {}
  StateDict named_parameters() const override {
    StateDict out;
    for (const auto& item : module_->named_parameters(true)) out.emplace_back(item.key(), item.value());
    return out;
  }
  StateDict named_buffers() const override {
    StateDict out;
    for (const auto& item : module_->named_buffers(true)) out.emplace_back(item.key(), item.value());
    return out;
  }
  StateDict state_dict() const override { return ddp::state_dict(*module_); }
  std::vector<std::string> sparse_gradient_parameters() const override {
    if (!owner_) return {};
    std::vector<std::string> sparse;
    for (const auto& item : module_->named_modules()) {
      const std::string prefix = item.key().empty() ? "" : item.key() + ".";
      if (auto* embedding = dynamic_cast<torch::nn::EmbeddingImpl*>(item.value().get())) {
        if (embedding->options.sparse()) sparse.push_back(prefix + "weight");
      } else if (auto* bag = dynamic_cast<torch::nn::EmbeddingBagImpl*>(item.value().get())) {
        if (bag->options.sparse()) sparse.push_back(prefix + "weight");
      }
    }
    return sparse;
  }

 private:
  std::shared_ptr<torch::nn::Module> owner_;
  torch::nn::Module* module_;
};

// A jit::Module is a handle: copies share the module, so holding one keeps
// the tensors we see the ones training changes.
class ScriptModuleTensors : public ModuleTensors {
 public:
  explicit ScriptModuleTensors(torch::jit::Module module) : module_(std::move(module)) {}
  StateDict named_parameters() const override {
    StateDict out;
    for (const auto& item : module_.named_parameters(true)) out.emplace_back(item.name, item.value);
    return out;
  }
  StateDict named_buffers() const override {
    StateDict out;
    for (const auto& item : module_.named_buffers(true)) out.emplace_back(item.name, item.value);
    return out;
  }
  StateDict state_dict() const override { return ddp::state_dict(module_); }

 private:
  torch::jit::Module module_;
};

}  // namespace

std::shared_ptr<ModuleTensors> module_tensors(std::shared_ptr<torch::nn::Module> module) {
  DDP_CHECK(module, "ddp: DistributedDataParallel got a null module");
  return std::make_shared<NativeModuleTensors>(std::move(module));
}

std::shared_ptr<ModuleTensors> module_tensors(const torch::jit::Module& module) {
  return std::make_shared<ScriptModuleTensors>(module);
}

void verify_replicas_match(const torch::nn::Module& module, ProcessGroup& group, const ReplicaCheckWording& wording) {
  NativeModuleTensors view(module);
  verify_replicas_match(static_cast<const ModuleTensors&>(view), group, wording);
}

void broadcast_module_state(torch::nn::Module& module, ProcessGroup& group, bool parameters, bool buffers,
                            int root) {
  NativeModuleTensors view(module);
  broadcast_module_state(static_cast<const ModuleTensors&>(view), group, parameters, buffers, root);
}

namespace {
// `text` from rank `root` to every rank, by collectives alone (the mpi
// backend has no shared store).
std::string broadcast_text(ProcessGroup& group, const std::string& text, int root) {
  at::Tensor length = at::full({1}, static_cast<int64_t>(text.size()), group.control_options().dtype(at::kLong));
  group.broadcast(length, root);
  at::Tensor bytes = at::zeros({length.item<int64_t>()}, at::TensorOptions().dtype(at::kByte));
  if (group.rank() == root) std::memcpy(bytes.data_ptr(), text.data(), text.size());
  at::Tensor sent = group.to_control(bytes);
  group.broadcast(sent, root);
  bytes = sent.cpu();
  return std::string(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(bytes.numel()));
}
}  // namespace

void verify_replicas_match(const ModuleTensors& module, ProcessGroup& group, const ReplicaCheckWording& wording) {
  if (group.size() == 1) return;
  CollectiveTag tag("replica check");
  auto mine = signatures_of(module);
  std::string encoded = encode_all(mine);

  at::Tensor hash = at::empty({1}, group.control_options().dtype(at::kLong));
  hash.fill_(static_cast<int64_t>(fnv1a(encoded)));
  auto hashes = group.all_gather(hash);
  std::vector<int> differing;
  for (int r = 1; r < group.size(); ++r) {
    if (hashes[r].item<int64_t>() != hashes[0].item<int64_t>()) differing.push_back(r);
  }
  if (differing.empty()) return;

  // Every rank takes part in both broadcasts, so all of them raise the same
  // error instead of some waiting for the others.
  int other = differing.front();
  auto root = decode_all(broadcast_text(group, encoded, 0));
  auto theirs = decode_all(broadcast_text(group, encoded, other));
  for (auto* signatures : {&root, &theirs}) {
    for (auto& signature : *signatures) signature.name = wording.name_prefix + signature.name;
  }
  DDP_CHECK(false, "ddp: ", wording.owner, " needs the same model on every rank, but ",
            describe_difference(root, other, theirs), " (", differing.size(), " rank(s) differ from rank 0). ",
            wording.fix);
}

void broadcast_module_state(const ModuleTensors& module, ProcessGroup& group, bool parameters,
                            bool buffers, int root) {
  if (group.size() == 1) return;
  std::vector<at::Tensor> tensors;
  if (parameters) {
    for (auto& [name, p] : module.named_parameters()) tensors.push_back(p);
  }
  if (buffers) {
    for (auto& [name, b] : module.named_buffers()) tensors.push_back(b);
  }
  CollectiveTag tag(parameters ? "broadcast of module state" : "buffer broadcast");
  broadcast_tensors(tensors, group, root);
}

void broadcast_tensors(const std::vector<at::Tensor>& tensors, ProcessGroup& group, int root) {
  if (group.size() == 1 || tensors.empty()) return;
  // One broadcast per dtype and device instead of one per tensor.
  std::map<std::pair<int, std::string>, std::vector<at::Tensor>> groups;
  for (const auto& t : tensors) {
    groups[{static_cast<int>(t.scalar_type()), t.device().str()}].push_back(t);
  }
  at::NoGradGuard no_grad;
  for (auto& [key, members] : groups) {
    std::vector<at::Tensor> flat_views;
    for (auto& t : members) flat_views.push_back(t.reshape({-1}));
    at::Tensor flat = at::cat(flat_views);
    group.broadcast(flat, root);
    // The root's tensors already hold what it sent.
    if (group.rank() == root) continue;
    int64_t offset = 0;
    for (auto& t : members) {
      t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

}  // namespace ddp::detail
