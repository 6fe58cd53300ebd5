// torchrun's per-rank stream specs: --redirects and --tee ("3", or "0:1,1:3" per local rank),
// and --local-ranks-filter ("0,2"). Pure parsing, no I/O.
#pragma once

#include <set>
#include <string>

namespace ddprun {

// Bits of a stream spec's value, as torchrun's Std numbers them.
constexpr int kStdOut = 1;
constexpr int kStdErr = 2;

// The streams (kStdOut | kStdErr bits) that `spec` selects for `local_rank`: a bare value
// 0..3 applies to every rank; in a mapping "R:V,R:V" a rank that is not listed gets 0 and a
// rank listed twice gets its last value, as with torchrun. Local ranks may have several digits
// (torchrun takes one). Throws std::invalid_argument saying what a spec looks like.
int std_streams_for(const std::string& spec, int local_rank);

// Throws std::invalid_argument if `spec` is neither a value 0..3 nor a mapping R:V,...
void check_std_spec(const std::string& spec);

// The local ranks of a --local-ranks-filter ("0,2"); empty input: no filter (an empty set).
// Throws std::invalid_argument unless it is a comma-separated list of integers >= 0.
std::set<int> parse_local_ranks(const std::string& list);

}  // namespace ddprun
