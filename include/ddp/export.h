#pragma once

// DDP_API marks what libddp exports: the public classes and functions of the
// headers in include/ddp. libddp is compiled with -fvisibility=hidden, so any
// other symbol stays inside the library and can change without breaking the
// programs linked against it; ddp's own tests link the internal static
// library (ddp_internal) to reach them.
//
// A static libddp exports nothing of its own: the program or shared library
// that links it decides what it shows. CMake defines DDP_STATIC for such a
// build, on libddp and on everything that links it (the installed package
// carries it too).
//
// ddp is POSIX-only, so there is no dllexport/dllimport pair to choose between.
#if defined(DDP_STATIC)
#define DDP_API
#elif defined(__GNUC__) || defined(__clang__)
#define DDP_API __attribute__((visibility("default")))
#else
#define DDP_API
#endif
