#pragma once

// Internal, not API: fmt as torch ships it, for ddp's number formatting.
// Torch installs fmt's headers but not its compiled library (libc10 and
// libtorch export none of fmt's functions), so each file that formats
// compiles fmt's few out-of-line functions itself (FMT_HEADER_ONLY). The
// macro is defined here, in the files that include this header, and not on
// the ddp target: a definition on the target would make the shared
// precompiled header (src/pch.h) unusable for the executables that reuse it,
// as a ddp_EXPORTS definition did (CMakeLists.txt, DEFINE_SYMBOL).

#if defined(FMT_VERSION) && !defined(FMT_HEADER_ONLY)
#error "fmt was included without FMT_HEADER_ONLY before src/common/fmt_header_only.h: include this header first"
#endif
#ifndef FMT_HEADER_ONLY
#define FMT_HEADER_ONLY
#endif
#include <fmt/format.h>
