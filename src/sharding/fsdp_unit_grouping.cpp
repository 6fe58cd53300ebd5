#include "sharding/fsdp_unit_grouping.h"

#include <ddp/error.h>

#include <algorithm>
#include <set>

namespace ddp::detail {

std::vector<SequentialGroup> group_sequential_children(const std::vector<std::pair<std::string, int64_t>>& children,
                                                       int64_t min_num_params, const std::vector<std::string>& listed) {
  DDP_CHECK(min_num_params >= 0, "ddp: FSDPOptions::min_num_params must be >= 0, got ", min_num_params);
  const std::set<std::string> named(listed.begin(), listed.end());
  for (const auto& name : named) {
    DDP_CHECK(std::any_of(children.begin(), children.end(), [&](const auto& child) { return child.first == name; }),
              "ddp: FSDPOptions::units names '", name, "', which is not a child of the Sequential root (its children ",
              "are named 0 to ", children.empty() ? 0 : children.size() - 1, ")");
  }
  std::vector<SequentialGroup> groups;
  SequentialGroup open;
  int64_t open_numel = 0;
  auto close = [&](bool forms_unit) {
    if (open.children.empty()) return;
    open.name = children[open.children.front()].first;
    if (open.children.size() > 1) open.name += "-" + children[open.children.back()].first;
    open.forms_unit = forms_unit;
    groups.push_back(std::move(open));
    open = SequentialGroup();
    open_numel = 0;
  };
  for (size_t child = 0; child < children.size(); ++child) {
    if (named.count(children[child].first)) {
      close(true);
      open.children.push_back(child);
      close(true);
      continue;
    }
    open.children.push_back(child);
    open_numel += children[child].second;
    if (min_num_params == 0) {
      close(false);
    } else if (open_numel >= min_num_params) {
      close(true);
    }
  }
  close(true);
  return groups;
}

}  // namespace ddp::detail
