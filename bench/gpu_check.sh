#!/usr/bin/env bash
# The GPU check: builds ddp against python3's torch, runs the gpu-labelled
# tests, the Wine example on the GPU (1 and 2 ranks), and the GPT benchmark
# side by side (ddp vs the bare model vs PyTorch's DDP) at 1 rank with NCCL
# and at 2 ranks on one GPU; writes logs, JSON results and results.md.
#
#   bench/gpu_check.sh OUT_DIR            # on the GPU machine, about 8 minutes on 16 cores
#   bench/gpu_check.sh OUT_DIR --cpu      # the same pipeline on the CPU at tiny sizes
#   bench/gpu_check.sh OUT_DIR --compact  # OUT_DIR gets 5 files only (device tool)
#
# Options: --cpu; --compact (OUT_DIR holds env.txt, stages.tsv, results.md,
# results.json and logs.tar.gz, all rewritten after every stage; the logs
# live in a scratch folder); --debs DIR (default <repo>/.gpu-debs if it has
# .deb files: scripts/fetch_gpu_debs.sh's Debian packages, unpacked with
# dpkg -x into a private prefix, never into /, for Gloo's headers,
# googletest and zlib).
#
# Every stage runs under `timeout`; a failed or timed-out stage is recorded
# in OUT_DIR/stages.tsv and results.md and the script goes on. Stages that
# would overrun the time budget are skipped and say so. results.md and
# results.json are rewritten after every stage, so an interrupted run
# leaves what it had measured.
#
# Environment: PYTHON (default python3; must import torch), BUILD_DIR
# (default <repo>/build-gpu-check, wiped first unless KEEP_BUILD=1),
# DEPS_PREFIX (default BUILD_DIR-deps, wiped and unpacked again each run),
# JOBS (default nproc), BUDGET_S (default 450), BUILD_LIMIT_S (default 330),
# ROUNDS_1 / ROUNDS_2 (benchmark rounds at 1 and 2 ranks, default 2 and 1),
# GPT_STEPS / GPT_WARMUP (default 15 / 5), GTEST_FROM_SOURCE=1 (build
# googletest from the carried sources even when Debian's libraries link).

set -uo pipefail

usage() {
  sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
}

[[ $# -ge 1 && $1 != -h && $1 != --help ]] || usage
OUT=$1
shift
CPU_MODE=0
COMPACT=0
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEBS_DIR=
[[ -n $(compgen -G "$ROOT/.gpu-debs/*.deb") ]] && DEBS_DIR=$ROOT/.gpu-debs
while [[ $# -gt 0 ]]; do
  case $1 in
    --cpu) CPU_MODE=1 ;;
    --compact) COMPACT=1 ;;
    --debs) [[ $# -ge 2 ]] || usage; DEBS_DIR=$2; shift ;;
    *) echo "gpu_check: unknown option $1" >&2; usage ;;
  esac
  shift
done

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
# WORK holds the logs and the benchmark's JSON lines: OUT itself, or with
# --compact a scratch folder that logs.tar.gz in OUT archives.
if [[ $COMPACT == 1 ]]; then
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
else
  WORK=$OUT
fi
LOGS=$WORK/logs
mkdir -p "$LOGS" "$WORK/gpt"
PYTHON=${PYTHON:-python3}
BUILD_DIR=${BUILD_DIR:-$ROOT/build-gpu-check}
DEPS_PREFIX=${DEPS_PREFIX:-$BUILD_DIR-deps}
BUILD_LIMIT_S=${BUILD_LIMIT_S:-330}
JOBS=${JOBS:-$(nproc)}
BUDGET_S=${BUDGET_S:-450}
ROUNDS_1=${ROUNDS_1:-2}
ROUNDS_2=${ROUNDS_2:-1}
GPT_STEPS=${GPT_STEPS:-15}
GPT_WARMUP=${GPT_WARMUP:-5}
START=$(date +%s)
STAGES=$OUT/stages.tsv
printf 'stage\trc\tseconds\tnote\n' > "$STAGES"
RUNS=$WORK/gpt/runs.jsonl
: > "$RUNS"
NOTES=()
IGNORED_FAILURES=(gpt_cpp_ddp_w2_nccl_probe_r0)

if [[ $CPU_MODE == 1 ]]; then
  DEVICE=cpu
  GPT_SIZE=(--layers 2 --d-model 64 --heads 2 --seq 32 --vocab 256 --batch 2 --threads 1)
  GPT_STEPS=${GPT_STEPS_CPU:-3}
  GPT_WARMUP=1
else
  DEVICE=cuda
  GPT_SIZE=(--layers 12 --d-model 768 --heads 12 --seq 1024 --vocab 50257 --batch 8)
fi
GPT_COMMON=(--device "$DEVICE" --steps "$GPT_STEPS" --warmup "$GPT_WARMUP" "${GPT_SIZE[@]}")

log() { echo "[gpu_check $(($(date +%s) - START))s] $*"; }

# ---------------------------------------------------------------------------
# The summary: results.json and results.md from env.txt, stages.tsv and the
# benchmark's JSON lines. Rewritten after every stage (and on SIGTERM), so a
# run cut short still leaves its results; --compact also archives the logs.
SUMMARY_PY=$(cat << 'PY'
import json, os, statistics, sys

out, work, cpu_mode, final = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
notes = sys.argv[5:]

def read(path, default=""):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return default

env = read(os.path.join(out, "env.txt"))
stages = [line.split("\t") for line in read(os.path.join(out, "stages.tsv")).splitlines()[1:] if line]
runs = []
for line in read(os.path.join(work, "gpt", "runs.jsonl")).splitlines():
    try:
        runs.append(json.loads(line))
    except ValueError:
        pass

by_config = {}
for r in runs:
    if r.get("round", 0) > 0:
        by_config.setdefault(r["config"], []).append(r)
summary = {}
for config, rs in by_config.items():
    last = rs[-1]
    summary[config] = {
        "runs": len(rs), "step_ms_median": statistics.median(r["step_ms_median"] for r in rs),
        "step_ms_per_run": [r["step_ms_median"] for r in rs],
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
        "mfu": statistics.median(r["mfu"] for r in rs) if all(r.get("mfu") is not None for r in rs) else None,
        "parameters": last["parameters"], "world": last["world"], "backend": last["backend"],
        "device": last["device"], "amp": last["amp"], "flops_per_token": last["flops_per_token"],
        "loss_first": last["loss_first"], "loss_last": last["loss_last"],
    }

def ratio(a, b):
    if a in summary and b in summary:
        return summary[a]["step_ms_median"] / summary[b]["step_ms_median"]
    return None

ratios = {
    "ours_over_python_ddp_w1": ratio("cpp_ddp_w1", "py_ddp_w1"),
    "ours_over_python_local_w1": ratio("cpp_local_w1", "py_local_w1"),
    "ours_ddp_over_local_w1": ratio("cpp_ddp_w1", "cpp_local_w1"),
    "python_ddp_over_local_w1": ratio("py_ddp_w1", "py_local_w1"),
    "ours_over_python_ddp_w2": ratio("cpp_ddp_w2", "py_ddp_w2"),
    "ours_ddp_over_local_w2": ratio("cpp_ddp_w2", "cpp_local_w2"),
}
state = {"done": "complete", "interrupted": "INTERRUPTED (signal): stages after the last row did not run"}.get(
    final, "IN PROGRESS or cut short: stages after the last row had not finished")
tmp = os.path.join(out, "results.json.part")
with open(tmp, "w") as f:
    json.dump({"state": state, "summary": summary, "ratios": ratios, "stages": stages, "notes": notes}, f, indent=1)
os.replace(tmp, os.path.join(out, "results.json"))

def fmt(x, spec="{:.3f}"):
    return "n/a" if x is None else spec.format(x)

lines = ["# GPU check results" + (" (CPU dry run, tiny model: not GPU figures)" if cpu_mode else ""), "",
         f"Run: {state}.", "", "```", env.strip(), "```", ""]
lines += [f"- note: {n}" for n in notes]
lines += ["", "## Stages", "", "| stage | exit | seconds | note |", "|---|---|---|---|"]
lines += [f"| {s[0]} | {s[1] if len(s) > 1 else ''} | {s[2] if len(s) > 2 else ''} | {s[3] if len(s) > 3 else ''} |"
          for s in stages]
lines += ["", "## GPT benchmark", "",
          "Median over runs of each run's median step time (warm-up excluded); configurations alternate within "
          "each round. MFU = flops_per_token x tokens/s / (GPUs x 989.5 TFLOP/s, H200 dense bf16), with "
          "flops_per_token = 6 x parameters + 12 x layers x d_model x seq. At world size 1, ddp's "
          "DistributedDataParallel has nothing to average and installs no hooks; PyTorch's DDP still runs "
          "its reducer.", "",
          "| config | world | backend | device | amp | params | runs | step ms | tokens/s | MFU | loss first -> last |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
for config, s in summary.items():
    lines.append(f"| {config} | {s['world']} | {s['backend']} | {s['device']} | {s['amp']} | {s['parameters']:,} | "
                 f"{s['runs']} | {s['step_ms_median']:.2f} | {s['tokens_per_s']:.0f} | {fmt(s['mfu'], '{:.1%}')} | "
                 f"{s['loss_first']:.4f} -> {s['loss_last']:.4f} |")
lines += ["", "| ratio (step time) | value |", "|---|---|"]
lines += [f"| {k} | {fmt(v)} |" for k, v in ratios.items()]
backend = read(os.path.join(work, "gpt", "backend_w2.txt")).strip()
if backend:
    lines += ["", f"Two ranks on one device used {backend}."]
tmp = os.path.join(out, "results.md.part")
with open(tmp, "w") as f:
    f.write("\n".join(lines) + "\n")
os.replace(tmp, os.path.join(out, "results.md"))
if final == "done":
    print("\n".join(lines))
PY
)

# snapshot [done|interrupted]: rewrites the results (and, with --compact,
# logs.tar.gz) from what the run has so far.
snapshot() {
  local final=${1:-partial}
  "$PYTHON" -c "$SUMMARY_PY" "$OUT" "$WORK" "$CPU_MODE" "$final" "${NOTES[@]}" \
    || python3 -c "$SUMMARY_PY" "$OUT" "$WORK" "$CPU_MODE" "$final" "${NOTES[@]}" \
    || echo "gpu_check: could not write the summary" >&2
  if [[ $COMPACT == 1 ]]; then
    tar -czf "$OUT/logs.tar.gz.part" -C "$WORK" logs gpt 2> /dev/null && mv -f "$OUT/logs.tar.gz.part" "$OUT/logs.tar.gz"
  fi
  return 0
}
trap 'log "interrupted"; printf "interrupted\t-\t0\tsignal\n" >> "$STAGES"; snapshot interrupted; exit 143' TERM INT HUP

# stage NAME TIMEOUT_S COMMAND...: runs COMMAND under timeout, logs to
# logs/NAME.log, records the outcome. Returns the command's status.
stage() {
  local name=$1 limit=$2
  shift 2
  local elapsed=$(($(date +%s) - START))
  if ((elapsed + 10 > BUDGET_S)); then
    log "SKIP $name: the ${BUDGET_S}s budget is spent (${elapsed}s)"
    printf '%s\t-\t0\tskipped: budget spent\n' "$name" >> "$STAGES"
    snapshot
    return 125
  fi
  # Never past the budget, however long the stage may take.
  ((limit > BUDGET_S - elapsed)) && limit=$((BUDGET_S - elapsed))
  log "RUN  $name (limit ${limit}s): $*"
  local t0 rc note=""
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  rc=$?
  ((rc == 124 || rc == 137)) && note="timed out after ${limit}s"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" "$note" >> "$STAGES"
  if ((rc == 0)); then log "OK   $name"; else log "FAIL $name (rc $rc${note:+, $note}); see logs/$name.log"; tail -5 "$LOGS/$name.log"; fi
  snapshot
  return "$rc"
}

# unpack_debs DEBS_DIR PREFIX: each .deb's files under PREFIX (dpkg-deb -x,
# or Python where dpkg is missing); absolute symlinks (libz.so ->
# /lib/x86_64-linux-gnu/libz.so.1.2.13) re-pointed into PREFIX, dangling
# ones removed.
unpack_debs() {
  local dir=$1 prefix=$2 deb link target
  rm -rf "$prefix"
  mkdir -p "$prefix" || return 1
  for deb in "$dir"/*.deb; do
    if command -v dpkg-deb > /dev/null && [[ ${DDP_UNPACK_WITH:-dpkg} == dpkg ]]; then
      dpkg-deb -x "$deb" "$prefix" || return 1
    else
      python3 - "$deb" "$prefix" << 'PY' || return 1
import io, sys, tarfile
deb, dest = sys.argv[1:3]
data = open(deb, "rb").read()
assert data[:8] == b"!<arch>\n", f"{deb}: not a .deb (ar) archive"
pos = 8
while pos + 60 <= len(data):
    header = data[pos:pos + 60]
    name, size = header[:16].decode().strip().rstrip("/"), int(header[48:58])
    body = data[pos + 60:pos + 60 + size]
    pos += 60 + size + (size & 1)
    if name.startswith("data.tar"):
        with tarfile.open(fileobj=io.BytesIO(body)) as tar:
            if hasattr(tarfile, "tar_filter"):
                tar.extractall(dest, filter="tar")
            else:
                tar.extractall(dest)
        sys.exit(0)
sys.exit(f"{deb}: no data.tar member")
PY
    fi
    echo "unpacked $(basename "$deb")"
  done
  while IFS= read -r link; do
    target=$(readlink "$link")
    if [[ $target == /* ]]; then
      ln -sfn "$prefix$target" "$link"
      echo "re-pointed $link -> $prefix$target"
    fi
  done < <(find "$prefix" -type l)
  while IFS= read -r link; do
    echo "removed dangling $link -> $(readlink "$link")"
    rm -f "$link"
  done < <(find "$prefix" -xtype l)
  echo "headers in $prefix/usr/include:"
  find "$prefix/usr/include" -type f | sed "s|^$prefix/usr/include/||" | cut -d/ -f1 | sort | uniq -c
}
export -f unpack_debs

# ---------------------------------------------------------------------------
# What the machine has.
{
  echo "date: $(date -Is)"
  echo "host: $(uname -n) $(uname -srm)"
  echo "os: $( (. /etc/os-release 2> /dev/null && echo "$PRETTY_NAME") || echo unknown); $(ldd --version 2>&1 | head -1)"
  echo "cores: $(nproc)"
  echo "mode: $([[ $CPU_MODE == 1 ]] && echo 'cpu (dry run)' || echo gpu)"
  if command -v nvidia-smi > /dev/null; then
    echo "gpus:"; nvidia-smi -L 2>&1 | sed 's/^/  /'
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/  /'
  else
    echo "gpus: nvidia-smi not found"
  fi
  echo "python: $PYTHON ($(command -v "$PYTHON"))"
  "$PYTHON" -c 'import sys, torch; print("python", sys.version.split()[0], "torch:", torch.__version__, "cuda:", torch.version.cuda, "available:", torch.cuda.is_available(), "devices:", torch.cuda.device_count(), "nccl:", torch.cuda.nccl.version() if torch.cuda.is_available() else None)' 2>&1
  for tool in cmake g++ c++ ninja make ccache nvcc mpicc dpkg-deb; do
    if command -v "$tool" > /dev/null; then echo "tool $tool: $(command -v "$tool") ($("$tool" --version 2>&1 | head -1))"; else echo "tool $tool: MISSING"; fi
  done
  echo "carried debs: ${DEBS_DIR:-none}"
  [[ -n $DEBS_DIR ]] && ls "$DEBS_DIR" 2>&1 | sed 's/^/  /'
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
snapshot

MISSING=()
command -v cmake > /dev/null || MISSING+=(cmake)
command -v c++ > /dev/null || command -v g++ > /dev/null || MISSING+=("a C++ compiler (g++)")
"$PYTHON" -c 'import torch' > /dev/null 2>&1 || MISSING+=("torch for $PYTHON")
CXX_BIN=$(command -v c++ || command -v g++)

# The carried Debian packages, in a prefix of our own.
PREFIX_INCLUDE=
if [[ -n $DEBS_DIR ]]; then
  if [[ -z $(compgen -G "$DEBS_DIR/*.deb") ]]; then
    NOTES+=("--debs $DEBS_DIR holds no .deb files")
  elif stage unpack_debs 60 bash -c 'unpack_debs "$@"' _ "$DEBS_DIR" "$DEPS_PREFIX"; then
    PREFIX_INCLUDE=$DEPS_PREFIX/usr/include
  fi
fi
# find_header HEADER: the first include folder (system, then the prefix) that has it.
find_header() {
  local dir
  for dir in /usr/include /usr/local/include $PREFIX_INCLUDE; do
    [[ -f $dir/$1 ]] && { echo "$dir"; return 0; }
  done
  return 1
}
GLOO_DIR=$(find_header gloo/config.h)
GTEST_DIR=$(find_header gtest/gtest.h)
ZLIB_DIR=$(find_header zlib.h)
[[ -n $GLOO_DIR ]] || MISSING+=("Gloo's headers (libgloo-dev: run scripts/fetch_gpu_debs.sh and carry .gpu-debs)")
JSON_DIR=$(find_header nlohmann/json.hpp)
CLI11_DIR=$(find_header CLI/CLI.hpp)
[[ -n $JSON_DIR ]] || MISSING+=("nlohmann's JSON headers (nlohmann-json3-dev: run scripts/fetch_gpu_debs.sh and carry .gpu-debs)")
[[ -n $CLI11_DIR ]] || MISSING+=("CLI11's headers (libcli11-dev: run scripts/fetch_gpu_debs.sh and carry .gpu-debs)")
SSL_DIR=$(find_header openssl/hmac.h)
[[ -n $SSL_DIR ]] || MISSING+=("OpenSSL's headers (libssl-dev: run scripts/fetch_gpu_debs.sh and carry .gpu-debs)")
HAVE_GTEST=0 HAVE_ZLIB=0
[[ -n $GTEST_DIR ]] && HAVE_GTEST=1
[[ -n $ZLIB_DIR ]] && HAVE_ZLIB=1
if ((${#MISSING[@]})); then
  log "cannot build: missing ${MISSING[*]}"
  printf 'prerequisites\t1\t0\tmissing: %s\n' "${MISSING[*]}" >> "$STAGES"
fi
GENERATOR="Unix Makefiles"
command -v ninja > /dev/null && GENERATOR=Ninja

# What CMake is told about the prefix. Gloo's headers are found through the
# compiler's include path (c10d's ProcessGroupGloo.hpp includes <gloo/...>),
# so the prefix's include folder goes on it; googletest and zlib are named
# to their CMake find modules.
DEPS_ARGS=()
# nlohmann_json and CLI11 are found by find_package through their CMake
# configs, which live under the prefix's usr/share/cmake.
[[ -n $PREFIX_INCLUDE ]] && DEPS_ARGS+=("-DCMAKE_PREFIX_PATH=$DEPS_PREFIX/usr")
CXX_FLAGS=
[[ -n $PREFIX_INCLUDE && ( $GLOO_DIR == "$PREFIX_INCLUDE" || $GTEST_DIR == "$PREFIX_INCLUDE" || $ZLIB_DIR == "$PREFIX_INCLUDE" ) ]] &&
  CXX_FLAGS="-isystem $PREFIX_INCLUDE"
# libcrypto (ddprun's HMAC) is named to FindOpenSSL, as zlib is to FindZLIB.
# Debian keeps OpenSSL's configuration.h in the multiarch include folder,
# which only the compiler's own search path names, so it goes on the flags.
if [[ -n $PREFIX_INCLUDE && $SSL_DIR == "$PREFIX_INCLUDE" ]]; then
  SSL_LIB=$(compgen -G "$DEPS_PREFIX/usr/lib/*/libcrypto.so" | head -1)
  DEPS_ARGS+=("-DOPENSSL_INCLUDE_DIR=$SSL_DIR")
  [[ -n $SSL_LIB ]] && DEPS_ARGS+=("-DOPENSSL_CRYPTO_LIBRARY=$SSL_LIB")
  SSL_CONF=$(compgen -G "$PREFIX_INCLUDE/*/openssl/configuration.h" | head -1)
  [[ -n $SSL_CONF ]] && CXX_FLAGS+="${CXX_FLAGS:+ }-isystem ${SSL_CONF%/openssl/configuration.h}"
fi
[[ -n $CXX_FLAGS ]] && DEPS_ARGS+=("-DCMAKE_CXX_FLAGS=$CXX_FLAGS")
if [[ $HAVE_ZLIB == 1 && $ZLIB_DIR == "$PREFIX_INCLUDE" ]]; then
  ZLIB_LIB=$(compgen -G "$DEPS_PREFIX/usr/lib/*/libz.so" || compgen -G "$DEPS_PREFIX/usr/lib/*/libz.a" | head -1)
  ZLIB_LIB=${ZLIB_LIB%%$'\n'*}
  DEPS_ARGS+=("-DZLIB_ROOT=$DEPS_PREFIX/usr" "-DZLIB_INCLUDE_DIR=$ZLIB_DIR")
  [[ -n $ZLIB_LIB ]] && DEPS_ARGS+=("-DZLIB_LIBRARY=$ZLIB_LIB")
fi
if [[ $HAVE_GTEST == 1 && $GTEST_DIR == "$PREFIX_INCLUDE" && ${#MISSING[@]} == 0 ]]; then
  # Debian built these static libraries with its gcc against its glibc: make
  # sure they link and run here, else build googletest from the carried
  # sources with this machine's compiler.
  GTEST_CONFIG=$(dirname "$(compgen -G "$DEPS_PREFIX/usr/lib/*/cmake/GTest/GTestConfig.cmake" | head -1)")
  GTEST_LIBDIR=$(dirname "$GTEST_CONFIG")/..
  PROBE=$DEPS_PREFIX/gtest-probe
  mkdir -p "$PROBE"
  printf '#include <gtest/gtest.h>\nTEST(Probe, Links) { EXPECT_EQ(1 + 1, 2); }\n' > "$PROBE/probe.cpp"
  GTEST_OK=0
  if [[ ${GTEST_FROM_SOURCE:-0} != 1 ]] &&
     stage gtest_probe 60 bash -c '"$1" -std=c++17 -isystem "$2" "$3/probe.cpp" "$4/libgtest_main.a" "$4/libgtest.a" -pthread -o "$3/probe" && "$3/probe"' \
       _ "$CXX_BIN" "$PREFIX_INCLUDE" "$PROBE" "$GTEST_LIBDIR"; then
    GTEST_OK=1
  elif [[ -d $DEPS_PREFIX/usr/src/googletest ]]; then
    if stage gtest_from_source 150 bash -c 'rm -rf "$2" && cmake -S "$1" -B "$2" -G "$3" -DCMAKE_BUILD_TYPE=Release -DBUILD_GMOCK=OFF -DINSTALL_GTEST=ON \
          -DCMAKE_POSITION_INDEPENDENT_CODE=ON -DCMAKE_INSTALL_PREFIX="$4" -DCMAKE_INSTALL_LIBDIR=lib \
        && cmake --build "$2" -j "$5" && cmake --install "$2"' \
        _ "$DEPS_PREFIX/usr/src/googletest" "$BUILD_DIR-gtest" "$GENERATOR" "$DEPS_PREFIX/gtest" "$JOBS"; then
      GTEST_CONFIG=$DEPS_PREFIX/gtest/lib/cmake/GTest
      GTEST_OK=1
      IGNORED_FAILURES+=(gtest_probe)
      NOTES+=("googletest built from the carried sources with this machine's compiler")
    fi
  fi
  if [[ $GTEST_OK == 1 ]]; then
    DEPS_ARGS+=("-DGTest_DIR=$GTEST_CONFIG")
  else
    HAVE_GTEST=0
  fi
fi
# The tests' CMake needs the examples' targets (tests/torch_tests.cmake), so
# no zlib means no tests either.
if [[ $HAVE_GTEST == 1 && $HAVE_ZLIB == 0 ]]; then
  HAVE_GTEST=0
  NOTES+=("no zlib, so no examples, so no tests: tests/torch_tests.cmake depends on the examples' targets")
fi
if [[ -z $GTEST_DIR ]]; then
  NOTES+=("googletest headers not found (libgtest-dev): tests not built, gpu tests skipped")
elif [[ $HAVE_GTEST == 0 ]]; then
  NOTES+=("the carried googletest neither links nor builds here (see gtest_probe, gtest_from_source): tests not built, gpu tests skipped")
fi
[[ $HAVE_ZLIB == 0 ]] && NOTES+=("zlib.h not found (zlib1g-dev): examples not built, Wine runs skipped")
[[ $GENERATOR != Ninja ]] && NOTES+=("ninja not found: using make")
[[ -n $PREFIX_INCLUDE ]] && NOTES+=("carried Debian packages unpacked in $DEPS_PREFIX: Gloo from $GLOO_DIR, googletest from ${GTEST_CONFIG:-${GTEST_DIR:-nowhere}}, zlib from ${ZLIB_DIR:-nowhere}, OpenSSL from ${SSL_DIR:-nowhere}")
for note in "${NOTES[@]}"; do log "NOTE $note"; done

# ---------------------------------------------------------------------------
# Build only what the check runs.
BUILT=0
if ((${#MISSING[@]} == 0)); then
  [[ ${KEEP_BUILD:-0} == 1 ]] || rm -rf "$BUILD_DIR"
  TESTS=OFF EXAMPLES=OFF
  [[ $HAVE_GTEST == 1 ]] && TESTS=ON
  [[ $HAVE_ZLIB == 1 ]] && EXAMPLES=ON
  CONFIGURE=(cmake -S "$ROOT" -B "$BUILD_DIR" -G "$GENERATOR" -DDDP_PYTHON="$(command -v "$PYTHON")"
    "-DDDP_BUILD_TESTS=$TESTS" "-DDDP_BUILD_EXAMPLES=$EXAMPLES" -DDDP_BUILD_BENCH=ON "${DEPS_ARGS[@]}"
    -DDDP_WITHOUT_MPI=ON)  # the check runs no MPI: one thing less that could differ there
  CONFIGURED=0
  if stage configure 180 "${CONFIGURE[@]}"; then
    CONFIGURED=1
    grep -E "^-- ddp:" "$LOGS/configure.log"
  else
    # A CUDA toolkit that torch's CMake config rejects (another CUDA version,
    # say): build against the CUDA headers of torch's wheel instead.
    rm -rf "$BUILD_DIR"
    if stage configure_without_toolkit 180 "${CONFIGURE[@]}" -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON; then
      CONFIGURED=1
      IGNORED_FAILURES+=(configure)
      grep -E "^-- ddp:" "$LOGS/configure_without_toolkit.log"
    fi
  fi
  if [[ $CONFIGURED == 1 ]]; then
    TARGETS=(ddprun gpt_bench)
    [[ $TESTS == ON ]] && TARGETS+=(gpu_worker ddp_worker ddp_gpu_tests)
    [[ $EXAMPLES == ON ]] && TARGETS+=(wine_ddp)
    stage build "$BUILD_LIMIT_S" cmake --build "$BUILD_DIR" -j "$JOBS" --target "${TARGETS[@]}" && BUILT=1
  fi
fi
BIN=$BUILD_DIR/bin

# ---------------------------------------------------------------------------
# Tests labelled gpu (they skip, saying why, without CUDA).
if [[ $BUILT == 1 && $HAVE_GTEST == 1 ]]; then
  stage gpu_tests 240 ctest --test-dir "$BUILD_DIR" -L gpu --output-on-failure --timeout 200
  grep -E "tests passed|Skipped|Failed|\*\*\*" "$LOGS/gpu_tests.log" | tail -15
fi

# ---------------------------------------------------------------------------
# The Wine example on the device, 1 and 2 ranks.
if [[ $BUILT == 1 && $HAVE_ZLIB == 1 ]]; then
  GPU_COUNT=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  for n in 1 2; do
    if [[ $DEVICE == cuda && $n -gt ${GPU_COUNT:-0} ]]; then
      # wine_ddp puts each rank on its own GPU with NCCL, which refuses two
      # ranks on one device; the GPT stage covers ranks sharing a GPU.
      printf 'wine_%srank\t-\t0\tskipped: %s GPU(s): one per rank needed\n' "$n" "$GPU_COUNT" >> "$STAGES"
      log "wine_${n}rank skipped: $GPU_COUNT GPU(s), one per rank needed"
      continue
    fi
    dir=$(mktemp -d)
    stage "wine_${n}rank" 120 "$BIN/ddprun" --standalone --nproc-per-node "$n" \
      "$BIN/wine_ddp" 20 10 --device "$DEVICE" --checkpoint-dir "$dir"
    grep -E "Test accuracy|error" "$LOGS/wine_${n}rank.log" | tail -3
    rm -rf "$dir"
  done
fi

# ---------------------------------------------------------------------------
# The GPT benchmark. Each run appends its JSON line, tagged, to
# gpt/runs.jsonl; configurations alternate within each round.
gpt_run() {  # gpt_run CONFIG ROUND LIMIT COMMAND...
  local config=$1 round=$2 limit=$3
  shift 3
  local name="gpt_${config}_r${round}"
  stage "$name" "$limit" "$@"
  local rc=$?
  local line
  line=$(grep -o '{"impl".*' "$LOGS/$name.log" 2> /dev/null | tail -1)
  if [[ $rc == 0 && -n $line ]]; then
    "$PYTHON" -c 'import json, sys; r = json.loads(sys.argv[1]); r.update(config=sys.argv[2], round=int(sys.argv[3])); print(json.dumps(r))' \
      "$line" "$config" "$round" >> "$RUNS"
    snapshot
  fi
  return "$rc"
}

if [[ $BUILT == 1 ]]; then
  DDPRUN=("$BIN/ddprun" --standalone)
  TORCHRUN=("$PYTHON" -m torch.distributed.run --standalone)
  PYBENCH=$ROOT/bench/python_gpt_bench.py
  LIMIT=90
  [[ $CPU_MODE == 1 ]] && export OMP_NUM_THREADS=1

  # World size 1: NCCL on the GPU (gloo on the CPU).
  for ((round = 1; round <= ROUNDS_1; round++)); do
    gpt_run cpp_ddp_w1 "$round" $LIMIT "${DDPRUN[@]}" --nproc-per-node 1 "$BIN/gpt_bench" --mode ddp "${GPT_COMMON[@]}"
    gpt_run py_ddp_w1 "$round" $LIMIT "${TORCHRUN[@]}" --nproc-per-node 1 "$PYBENCH" --mode ddp "${GPT_COMMON[@]}"
    gpt_run cpp_local_w1 "$round" $LIMIT "$BIN/gpt_bench" --mode local "${GPT_COMMON[@]}"
    gpt_run py_local_w1 "$round" $LIMIT "$PYTHON" "$PYBENCH" --mode local "${GPT_COMMON[@]}"
  done

  # Two ranks on one GPU: NCCL if it accepts them (it normally refuses two
  # ranks on one device), else gloo.
  BACKEND2=gloo
  if [[ $CPU_MODE == 0 ]]; then
    if gpt_run cpp_ddp_w2_nccl_probe 0 60 "${DDPRUN[@]}" --nproc-per-node 2 "$BIN/gpt_bench" --mode ddp \
        --backend nccl --share-devices "${GPT_COMMON[@]}" --steps 2 --warmup 1; then
      BACKEND2=nccl
    fi
  fi
  log "two ranks on one device use $BACKEND2"
  echo "$BACKEND2" > "$WORK/gpt/backend_w2.txt"
  for ((round = 1; round <= ROUNDS_2; round++)); do
    gpt_run cpp_ddp_w2 "$round" $LIMIT "${DDPRUN[@]}" --nproc-per-node 2 "$BIN/gpt_bench" --mode ddp \
      --backend "$BACKEND2" --share-devices "${GPT_COMMON[@]}"
    gpt_run py_ddp_w2 "$round" $LIMIT "${TORCHRUN[@]}" --nproc-per-node 2 "$PYBENCH" --mode ddp \
      --backend "$BACKEND2" --share-devices "${GPT_COMMON[@]}"
    gpt_run cpp_local_w2 "$round" $LIMIT "${DDPRUN[@]}" --nproc-per-node 2 "$BIN/gpt_bench" --mode local \
      --share-devices "${GPT_COMMON[@]}"
  done
fi

# ---------------------------------------------------------------------------
# The summary, complete.
trap - TERM INT HUP
snapshot done
[[ $COMPACT == 1 ]] && rm -rf "$WORK"

# Failures that a later stage made up for (the NCCL probe, a configure
# retried without the toolkit, Debian's googletest rebuilt) do not fail the check.
FAILED=$(awk -F'\t' -v ignored=" ${IGNORED_FAILURES[*]} " \
  'NR > 1 && $2 != "0" && $2 != "-" && index(ignored, " " $1 " ") == 0' "$STAGES" | cut -f1 | tr '\n' ' ')
log "done in $(($(date +%s) - START))s; results in $OUT/results.md"
if [[ -n $FAILED ]]; then
  log "failed stages: $FAILED"
  exit 1
fi
exit 0
