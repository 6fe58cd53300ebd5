#pragma once

// Deprecated: the reducer is ddp::BucketReducer, in <ddp/bucket_reducer.h>,
// which also keeps the old name ddp::GradientReducer as a deprecated alias.
#include <ddp/bucket_reducer.h>
