#!/usr/bin/env bash
# Installs what ddp needs to build and test, idempotently, and prints the
# virtualenv's path on its last line. Fast when everything is already there.
#
#   DDP_CACHE_DIR  where cached virtualenvs live (default ~/.cache/ddp)
#   DDP_VENV       use this virtualenv instead (must already hold torch)
set -euo pipefail

TORCH_VERSION=2.11.0
REQUIREMENTS="$(cd "$(dirname "$0")" && pwd)/requirements.txt"
# openmpi-bin, slurm-wlm and iproute2 serve the cluster tests (mpirun, a
# single-host Slurm, network namespaces); libopenmpi-dev the mpi backend; binutils' nm and readelf the Gloo
# header checks; nlohmann-json3-dev and libcli11-dev the JSON and command-line
# libraries (header-only) of the library, ddprun, the examples and benchmarks;
# libssl-dev the HMAC-SHA256 (OpenSSL's libcrypto) of ddprun's rendezvous secret;
# libcurl4-openssl-dev the etcd v2 client (src/common/etcd_v2_client.cpp) of the
# fault-tolerance store and ddprun's etcd-v2 rendezvous; etcd-server and
# etcd-client the 3-member etcd clusters the etcd tests start (test_etcd_store,
# test_etcd_rendezvous) and etcdctl for inspecting one.
APT_PACKAGES=(build-essential cmake ninja-build ccache libgloo-dev libgtest-dev binutils
              python3 python3-venv iproute2 procps openmpi-bin libopenmpi-dev slurm-wlm valgrind
              nlohmann-json3-dev libcli11-dev libssl-dev libcurl4-openssl-dev etcd-server etcd-client)

log() { printf 'setup: %s\n' "$*" >&2; }

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    log "missing Debian packages: ${missing[*]}; install them as root (apt-get install ${missing[*]})"
    exit 1
  fi
  log "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

if [ -n "${DDP_VENV:-}" ]; then
  venv="$DDP_VENV"
  [ -x "$venv/bin/python" ] || { log "DDP_VENV=$venv has no bin/python"; exit 1; }
else
  py_tag=$(python3 -c 'import sys; print(f"py{sys.version_info[0]}.{sys.version_info[1]}")')
  venv="${DDP_CACHE_DIR:-$HOME/.cache/ddp}/torch-${TORCH_VERSION}-${py_tag}"
  # The marker holds the requirements' checksum: a changed list updates the
  # cached virtualenv in place instead of downloading torch again.
  wanted=$(sha256sum "$REQUIREMENTS" | cut -d' ' -f1)
  if [ "$(cat "$venv/.ddp-complete" 2>/dev/null)" != "$wanted" ]; then
    if [ ! -x "$venv/bin/python" ]; then
      log "installing torch==${TORCH_VERSION} into $venv (about 3 GB, once per machine)"
      rm -rf "$venv"
      mkdir -p "$(dirname "$venv")"
      python3 -m venv "$venv"
    else
      log "updating the Python packages in $venv"
    fi
    "$venv/bin/pip" install -q --disable-pip-version-check --progress-bar off -r "$REQUIREMENTS" >&2
    echo "$wanted" > "$venv/.ddp-complete"
  fi
fi

version=$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')
if [ "$version" != "$TORCH_VERSION" ]; then
  log "$venv holds torch $version, but ddp pins $TORCH_VERSION"
  exit 1
fi
echo "$venv"
