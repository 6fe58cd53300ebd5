// libddp shows its API and nothing else: it is compiled with
// -fvisibility=hidden, and DDP_API (include/ddp/export.h) marks what it
// exports. A symbol of ddp::detail is exported only where a template or an
// inline function of a public header calls it; those are listed below, so
// that exporting another one is a decision made here, not an accident.

#include <gtest/gtest.h>
#include <support/subprocess.h>

#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace {

// The demangled names libddp exports (`nm -D -C --defined-only`).
std::vector<std::string> exported_names() {
  auto result = ddp::testing::run_process({"nm", "-D", "-C", "--defined-only", DDP_LIBRARY_PATH});
  EXPECT_EQ(result.exit_code, 0) << result.describe();
  std::vector<std::string> names;
  std::istringstream in(result.out);
  // 16 hex digits, a space, the symbol type, a space, the name.
  for (std::string line; std::getline(in, line);) {
    if (line.size() > 19) names.push_back(line.substr(19));
  }
  return names;
}

// "ddp::detail::DdpRuntime::before_forward()" -> "DdpRuntime"; "" outside ddp::detail.
std::string detail_entity(std::string name) {
  for (const char* prefix : {"typeinfo name for ", "typeinfo for ", "vtable for "}) {
    if (name.rfind(prefix, 0) == 0) name = name.substr(std::string(prefix).size());
  }
  const std::string detail = "ddp::detail::";
  if (name.rfind(detail, 0) != 0) return "";
  const std::string rest = name.substr(detail.size());
  return rest.substr(0, rest.find_first_of(":([<"));
}

TEST(Exports, DetailSymbolsAreOnlyThoseThePublicTemplatesCall) {
  const std::set<std::string> allowed = {
      // DistributedDataParallel<M> holds a DdpRuntime and calls it inline.
      "DdpRuntime", "collect_tensors", "load_on_root_and_broadcast", "module_tensors",
      // FsdpUnitImpl<M> derives from FsdpUnitModule.
      "FsdpUnitModule",
      // clip_grad_norm_(model, ...) for DDP and FSDP.
      "clip_grad_norm", "refuse_clipping_after_step_in_backward",
      // save_distributed_checkpoint / load_distributed_checkpoint.
      "save_fsdp_checkpoint", "read_fsdp_checkpoint", "save_replicated_checkpoint", "load_replicated_checkpoint",
      "all_indices", "optimizer_state_or_none", "load_optimizer_state_or_none",
      // The sharded snapshot's save and load_newest_sharded_snapshot.
      "progress_metadata", "valid_sharded_snapshots", "agree_on_candidates", "agree_on_load", "message_of",
      "check_not_left_partly_loaded", "note_resumed_from"};
  for (const auto& name : exported_names()) {
    const std::string entity = detail_entity(name);
    EXPECT_TRUE(entity.empty() || allowed.count(entity)) << "libddp exports an internal symbol: " << name;
  }
}

TEST(Exports, ApiIsExportedAndInternalsAreNot) {
  const auto names = exported_names();
  auto exported = [&](const std::string& prefix) {
    for (const auto& name : names) {
      if (name.rfind(prefix, 0) == 0) return true;
    }
    return false;
  };
  EXPECT_TRUE(exported("ddp::init_process_group("));
  EXPECT_TRUE(exported("ddp::ProcessGroup::all_reduce("));
  EXPECT_TRUE(exported("typeinfo for ddp::Error"));
  // Internal helpers of the environment and the sampler, and the process
  // group's state behind its pointer (src/comm/process_group_impl.h).
  EXPECT_FALSE(exported("ddp::parse_int_env("));
  EXPECT_FALSE(exported("ddp::make_batches("));
  EXPECT_FALSE(exported("ddp::detail::RingCollectives"));
  EXPECT_FALSE(exported("ddp::detail::GradientSyncEngine"));
}

}  // namespace
