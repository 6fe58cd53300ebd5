#!/usr/bin/env bash
# Downloads the Debian packages that bench/gpu_check.sh needs on a bare GPU
# machine (Gloo's headers, googletest, zlib's header), exactly the versions
# pinned in bench/gpu_debs.txt, into .gpu-debs/ (ignored by git), for a
# device run to carry. Installs nothing: `apt-get download` only fetches.
#
#   bash scripts/fetch_gpu_debs.sh [DIR]     # DIR defaults to <repo>/.gpu-debs
#
# Runs `apt-get update` first when apt has no package lists. Fails, naming
# the package, when a pinned version is no longer available.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MANIFEST=$ROOT/bench/gpu_debs.txt
DIR=${1:-$ROOT/.gpu-debs}

command -v apt-get > /dev/null || { echo "fetch_gpu_debs: apt-get not found (a Debian/Ubuntu machine is needed)" >&2; exit 1; }
mapfile -t PINS < <(grep -Ev '^[[:space:]]*(#|$)' "$MANIFEST")
((${#PINS[@]})) || { echo "fetch_gpu_debs: no packages in $MANIFEST" >&2; exit 1; }

if ! apt-cache show "${PINS[0]%%=*}" > /dev/null 2>&1; then
  echo "fetch_gpu_debs: no package lists; running apt-get update"
  apt-get update
fi

mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
# Only the pinned files: stale versions would be unpacked too.
rm -f "$DIR"/*.deb
(cd "$DIR" && apt-get download "${PINS[@]}")

status=0
for pin in "${PINS[@]}"; do
  pkg=${pin%%=*} version=${pin#*=}
  found=0
  for deb in "$DIR"/*.deb; do
    if [[ $(dpkg-deb -f "$deb" Package) == "$pkg" && $(dpkg-deb -f "$deb" Version) == "$version" ]]; then
      found=1
      echo "  $pkg $version: $(basename "$deb") ($(stat -c %s "$deb") bytes)"
    fi
  done
  [[ $found == 1 ]] || { echo "fetch_gpu_debs: $pkg=$version missing from $DIR" >&2; status=1; }
done
((status == 0)) && echo "fetch_gpu_debs: ${#PINS[@]} packages in $DIR; carry it (\"$(basename "$DIR")\") with the device run"
exit "$status"
