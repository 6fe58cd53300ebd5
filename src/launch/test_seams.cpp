#include "launch/test_seams.h"

namespace ddp::detail {

TestSeams& test_seams() {
  static TestSeams seams;
  return seams;
}

}  // namespace ddp::detail
