#!/usr/bin/env bash
# usage: is_configured.sh BUILD_DIR PYTHON
# Exits 0 when BUILD_DIR was configured by CMake against PYTHON's torch, so
# `make` (and `make install`) can skip re-running cmake. CMake records a
# -D value given without a type as :UNINITIALIZED, and one that a cache
# variable declared as :FILEPATH; both count.
set -euo pipefail
cache="$1/CMakeCache.txt"
[ -f "$cache" ] && grep -qxE "DDP_PYTHON:(FILEPATH|UNINITIALIZED|STRING)=$2" "$cache"
