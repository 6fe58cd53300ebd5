#include "engine/hierarchical_choice.h"

#include <algorithm>
#include <string>

namespace ddp::detail {
namespace {

// "rank 2" or "ranks 2, 3".
std::string ranks_text(const std::vector<int>& ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) text += (i ? ", " : "") + std::to_string(ranks[i]);
  return text;
}

// `what`, and on which ranks when not on all of them.
std::string said_by(const std::string& what, const std::vector<int>& ranks, size_t world) {
  return ranks.size() == world ? what : what + " on " + ranks_text(ranks);
}

}  // namespace

HierarchicalWish hierarchical_wish(const std::optional<bool>& option, const char* env) {
  if (option) return *option ? HierarchicalWish::kOnByOption : HierarchicalWish::kOffByOption;
  if (!env) return HierarchicalWish::kAuto;
  const std::string value = env;
  if (value.empty() || value == "auto" || value == "1") return HierarchicalWish::kAuto;
  if (value == "0") return HierarchicalWish::kOffByEnv;
  return HierarchicalWish::kInvalid;
}

HierarchicalChoice choose_hierarchical_allreduce(const std::vector<HierarchicalVote>& votes) {
  HierarchicalChoice choice;
  std::vector<int64_t> seen;
  std::vector<int> ranks_per_host;
  std::vector<int> invalid, off_by_option, off_by_env, insisting, not_cpu;
  for (size_t r = 0; r < votes.size(); ++r) {
    const HierarchicalVote& vote = votes[r];
    auto found = std::find(seen.begin(), seen.end(), vote.host);
    if (found == seen.end()) {
      seen.push_back(vote.host);
      ranks_per_host.push_back(0);
      found = seen.end() - 1;
    }
    const int host = static_cast<int>(found - seen.begin());
    choice.host_of_rank.push_back(host);
    ++ranks_per_host[host];
    const int rank = static_cast<int>(r);
    switch (vote.wish) {
      case HierarchicalWish::kInvalid: invalid.push_back(rank); break;
      case HierarchicalWish::kOffByOption: off_by_option.push_back(rank); break;
      case HierarchicalWish::kOffByEnv: off_by_env.push_back(rank); break;
      case HierarchicalWish::kOnByOption: insisting.push_back(rank); break;
      case HierarchicalWish::kAuto: break;
    }
    if (!vote.cpu) not_cpu.push_back(rank);
  }
  choice.hosts = static_cast<int>(seen.size());
  const int largest = ranks_per_host.empty() ? 0 : *std::max_element(ranks_per_host.begin(), ranks_per_host.end());
  choice.layout_fits = choice.hosts > 1 && largest > 1;

  if (!invalid.empty()) {
    choice.error = "ddp: DDP_HIERARCHICAL on " + ranks_text(invalid) + " is not 0, 1 or auto; unset it (ddp " +
                   "chooses) or set 0 (the flat all-reduce), alike on every rank";
    return choice;
  }
  const bool refused = !off_by_option.empty() || !off_by_env.empty();
  if (!insisting.empty()) {
    const std::string asked =
        "ddp: DDPOptions::hierarchical_allreduce(true) on " + ranks_text(insisting) + " asks for the hierarchical "
        "all-reduce, ";
    if (refused) {
      std::vector<int> refusing = off_by_option;
      refusing.insert(refusing.end(), off_by_env.begin(), off_by_env.end());
      std::sort(refusing.begin(), refusing.end());
      choice.error = asked + "but " + ranks_text(refusing) + " refuse it (hierarchical_allreduce(false) or " +
                     "DDP_HIERARCHICAL=0), and every rank must take the same path; make them agree";
    } else if (!not_cpu.empty()) {
      choice.error = asked + "which reduces CPU tensors (shared memory or Gloo within a host), but the parameters " +
                     "of " + ranks_text(not_cpu) + " are not on the CPU; drop the option";
    } else if (!choice.layout_fits) {
      choice.error = asked + "which needs ranks on more than one host and more than one rank on some host, but " +
                     "this group has " + std::to_string(votes.size()) + " rank(s) on " + std::to_string(choice.hosts) +
                     (choice.hosts == 1 ? " host" : " hosts, one each") + "; drop the option (ddp then chooses)";
    } else {
      choice.hierarchical = true;
    }
    return choice;
  }
  if (!choice.layout_fits) return choice;
  if (!off_by_option.empty()) {
    choice.why_flat = said_by("DDPOptions::hierarchical_allreduce(false)", off_by_option, votes.size());
  } else if (!off_by_env.empty()) {
    choice.why_flat = said_by("DDP_HIERARCHICAL=0", off_by_env, votes.size());
  } else if (!not_cpu.empty()) {
    choice.why_flat = said_by("parameters not on the CPU", not_cpu, votes.size());
  } else {
    choice.hierarchical = true;
  }
  return choice;
}

}  // namespace ddp::detail
