#pragma once

// Internal to the library, not installed: how the children of a torch::nn::Sequential root are
// grouped into FSDP units (FSDPOptions::min_num_params and ::units). A pure
// function of the children's names and sizes, unit-tested like the bucket
// assignment; FsdpRuntime applies it to the module.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace ddp::detail {

/// Consecutive children that run together.
struct SequentialGroup {
  std::vector<size_t> children;  ///< indices into the Sequential, ascending
  std::string name;              ///< "3", or "0-2" for several children
  /// Whether the group forms a unit; if not, its parameters belong to the
  /// root unit (an unlisted child without a size policy).
  bool forms_unit = false;
};

/// Groups `children` (name and number of parameters, in order).
///  * A child named in `listed` is a unit of its own.
///  * With min_num_params > 0, the others are grouped greedily: a group
///    closes once it holds at least min_num_params; a smaller tail is a unit
///    of its own, and a listed child closes the group before it.
///  * With min_num_params == 0, every unlisted child is a group of its own
///    that forms no unit.
/// Throws if `listed` names a child that does not exist.
std::vector<SequentialGroup> group_sequential_children(const std::vector<std::pair<std::string, int64_t>>& children,
                                                       int64_t min_num_params, const std::vector<std::string>& listed);

}  // namespace ddp::detail
