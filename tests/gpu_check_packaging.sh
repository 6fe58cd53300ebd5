#!/usr/bin/env bash
# Cheap checks of what bench/gpu_check.sh needs on a bare GPU machine (no
# network, no build):
#   gpu_check_packaging.sh scripts SOURCE_DIR   the scripts parse, the manifest is well-formed
#   gpu_check_packaging.sh carried SOURCE_DIR   .gpu-debs holds exactly the pinned packages
#                                               (exit 77, skipped, when it was never fetched)
set -uo pipefail
mode=$1 src=$2
manifest=$src/bench/gpu_debs.txt
fail() { echo "FAIL: $*"; exit 1; }

mapfile -t pins < <(grep -Ev '^[[:space:]]*(#|$)' "$manifest")
case $mode in
  scripts)
    for script in bench/gpu_check.sh scripts/fetch_gpu_debs.sh; do
      bash -n "$src/$script" || fail "$script does not parse"
      [[ -x $src/$script ]] || fail "$script is not executable"
    done
    ((${#pins[@]})) || fail "no packages in $manifest"
    for pin in "${pins[@]}"; do
      [[ $pin =~ ^[a-z0-9][a-z0-9+.-]+=[0-9][A-Za-z0-9.+:~-]*$ ]] || fail "not package=version: '$pin'"
    done
    # What the build cannot do without (Gloo's headers for the library,
    # googletest for the gpu tests, zlib.h for the examples' configure,
    # nlohmann's JSON and CLI11 for the library, ddprun and the examples,
    # OpenSSL's libcrypto for ddprun).
    for needed in libgloo-dev libgtest-dev zlib1g-dev nlohmann-json3-dev libcli11-dev libssl-dev libssl3; do
      printf '%s\n' "${pins[@]}" | grep -q "^$needed=" || fail "$needed is not pinned in $manifest"
    done
    dupes=$(printf '%s\n' "${pins[@]}" | cut -d= -f1 | sort | uniq -d)
    [[ -z $dupes ]] || fail "pinned twice: $dupes"
    "$src/bench/gpu_check.sh" --help > /dev/null 2>&1
    (($? == 2)) || fail "gpu_check.sh --help does not print its usage"
    echo "ok: scripts parse; ${#pins[@]} packages pinned"
    ;;
  carried)
    dir=$src/.gpu-debs
    if [[ -z $(compgen -G "$dir/*.deb") ]]; then
      echo "SKIP: $dir holds no .deb files (bash scripts/fetch_gpu_debs.sh fetches them)"
      exit 77
    fi
    # A .deb file is named package_version_arch.deb, with the version's ':' as %3a.
    names=$(cd "$dir" && ls *.deb)
    for pin in "${pins[@]}"; do
      pkg=${pin%%=*} version=${pin#*=}
      file_version=${version//:/%3a}
      grep -qxF -e "${pkg}_${file_version}_amd64.deb" -e "${pkg}_${file_version}_all.deb" <<< "$names" \
        || fail "$pkg=$version is pinned but not in $dir (run scripts/fetch_gpu_debs.sh again)"
      if command -v dpkg-deb > /dev/null; then
        deb=$(compgen -G "$dir/${pkg}_${file_version}_*.deb" | head -1)
        [[ $(dpkg-deb -f "$deb" Package Version | tr '\n' ' ') == "Package: $pkg Version: $version " ]] \
          || fail "$deb is not $pkg $version inside"
      fi
    done
    extra=$(wc -l <<< "$names")
    ((extra == ${#pins[@]})) || fail "$dir holds $extra .deb files for ${#pins[@]} pins: stale ones would be unpacked too"
    echo "ok: $dir holds exactly the ${#pins[@]} pinned packages"
    ;;
  *) fail "unknown mode $mode" ;;
esac
