#!/usr/bin/env bash
# usage: check.sh MODE DDP_BUILD_DIR DDP_SOURCE_DIR
#   MODE: installed (cmake --install into a temporary prefix, find_package),
#         build-tree (find_package with ddp_DIR=<build dir>),
#         fetchcontent (FetchContent_Declare(ddp SOURCE_DIR ...)),
#         examples (the examples built on their own against the installed package,
#                   as README's "Using ddp in your project" says, and run)
set -euo pipefail
mode=$1 build=$2 source=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
args=(-G Ninja -DCMAKE_BUILD_TYPE=Release)
case "$mode" in
  examples)
    cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
    # Unoptimised: what is checked is that they build and run against the
    # package, and -O0 compiles faster than Release on 2 cores.
    args=(-G Ninja -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_CXX_FLAGS_DEBUG=-O0")
    for example in torchscript digits; do
      cmake -S "$source/examples/$example" -B "$work/$example" "${args[@]}" -DCMAKE_PREFIX_PATH="$work/prefix" \
        > "$work/$example.configure.log" 2>&1 || { cat "$work/$example.configure.log"; exit 1; }
      cmake --build "$work/$example" -j 2 > "$work/$example.build.log" 2>&1 || { tail -50 "$work/$example.build.log"; exit 1; }
    done
    mkdir -p "$work/runs"
    "$work/torchscript/wine/wine_single" 2 2 --checkpoint-dir "$work/runs" | tee "$work/wine.log"
    grep -q "Test accuracy" "$work/wine.log"
    "$work/prefix/bin/ddprun" --standalone --nproc-per-node 2 "$work/torchscript/wine/wine_ddp" 2 2 \
      --checkpoint-dir "$work/runs" --no-resume | tee "$work/wine_ddp.log"
    grep -q "Test accuracy" "$work/wine_ddp.log"
    test -x "$work/torchscript/wine/wine_sharded" && test -x "$work/torchscript/train_scripted"
    mkdir -p "$work/runs-digits"
    "$work/digits/digits_ddp" 1 1 --checkpoint-dir "$work/runs-digits" | tee "$work/digits.log"
    grep -q "Test accuracy" "$work/digits.log"
    echo "examples ok: built against the installed package and run"
    exit 0 ;;
  installed)
    cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
    args+=(-DCMAKE_PREFIX_PATH="$work/prefix") ;;
  build-tree)
    args+=(-Dddp_DIR="$build") ;;
  fetchcontent)
    python=$(grep '^DDP_PYTHON:' "$build/CMakeCache.txt" | cut -d= -f2)
    # The library compiles again from source here, which takes minutes on
    # 2 cores; unoptimised (-O0), as in examples mode, since what is checked
    # is that it builds and links this way.
    args=(-G Ninja -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_CXX_FLAGS_DEBUG=-O0"
          -DDDP_CONSUME=fetchcontent -DDDP_SOURCE="$source" -DDDP_PYTHON="$python"
          # What only ddprun and ddp's tests need is made unfindable: a
          # project that includes ddp need not have it.
          -DCMAKE_DISABLE_FIND_PACKAGE_CLI11=TRUE -DCMAKE_DISABLE_FIND_PACKAGE_OpenSSL=TRUE
          -DCMAKE_DISABLE_FIND_PACKAGE_GTest=TRUE) ;;
  *) echo "unknown mode $mode" >&2; exit 2 ;;
esac
cmake -S "$source/tests/consumer" -B "$work/build" "${args[@]}" > "$work/configure.log" 2>&1 \
  || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" -j 2 > "$work/build.log" 2>&1 || { tail -50 "$work/build.log"; exit 1; }
out=$("$work/build/consumer")
echo "$out"
[ "$out" = "consumer ok: world 1, 2 tensors" ]
if [ "$mode" = fetchcontent ]; then
  # Included, ddp follows the including project: no launcher, no install
  # rules, and a static libddp since the project did not ask for shared ones.
  if find "$work/build" -name ddprun -type f | grep -q .; then
    echo "ddprun was built in a project that includes ddp" >&2; exit 1
  fi
  find "$work/build" -name libddp.a | grep -q . \
    || { echo "no static libddp.a in a project without BUILD_SHARED_LIBS" >&2; exit 1; }
  if find "$work/build" -name 'libddp.so*' | grep -q .; then
    echo "a shared libddp in a project without BUILD_SHARED_LIBS" >&2; exit 1
  fi
  cmake --install "$work/build" --prefix "$work/fc-prefix" > "$work/fc-install.log"
  if [ -n "$(find "$work/fc-prefix" -type f 2>/dev/null)" ]; then
    echo "the including project installs ddp's files:" >&2; find "$work/fc-prefix" -type f >&2; exit 1
  fi
  echo "fetchcontent ok: without CLI11, OpenSSL and GTest; static libddp; no launcher; nothing installed"
fi
if [ "$mode" = installed ]; then
  # The installed package carries the launcher and the headers too.
  test -x "$work/prefix/bin/ddprun"
  test -f "$work/prefix/include/ddp/distributed_data_parallel.h"
  test -f "$work/prefix/include/ddp/ddp.h"
  # Every RUNPATH entry of the installed library is a real directory (torch's
  # MKL config once added /lib/intel64_win and the like).
  lib=$(ls "$work/prefix"/lib*/libddp.so)
  rpath=$(readelf -d "$lib" | sed -n 's/.*R\(UN\)\{0,1\}PATH.*\[\(.*\)\]/\2/p')
  echo "installed libddp.so RUNPATH: $rpath"
  # An empty entry would make the loader search the working directory.
  case ":$rpath:" in *::*) echo "empty RUNPATH entry in $lib" >&2; exit 1 ;; esac
  IFS=: read -ra dirs <<< "$rpath"
  for dir in "${dirs[@]}"; do
    case "$dir" in
      *intel64*|*win-x64*|/lib) echo "junk RUNPATH entry '$dir' in $lib" >&2; exit 1 ;;
    esac
    [ -d "$dir" ] || { echo "RUNPATH entry '$dir' of $lib does not exist" >&2; exit 1; }
  done
  "$work/prefix/bin/ddprun" --nproc-per-node 1 --standalone "$work/build/consumer"
fi
