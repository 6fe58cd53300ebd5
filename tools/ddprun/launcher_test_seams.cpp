#include "launcher_test_seams.h"

namespace ddprun::detail {

TestSeams& test_seams() {
  static TestSeams seams;
  return seams;
}

}  // namespace ddprun::detail
