#!/usr/bin/env bash
# The GPU check: builds ddp against python3's torch, runs the gpu-labelled
# tests, the Wine example on the GPU (1 and 2 ranks), and the GPT benchmark
# side by side (ddp vs the bare model vs PyTorch's DDP) at 1 rank with NCCL
# and at 2 ranks on one GPU; writes logs, JSON results and results.md.
#
#   bench/gpu_check.sh OUT_DIR            # on the GPU machine, about 8 minutes on 16 cores
#   bench/gpu_check.sh OUT_DIR --cpu      # the same pipeline on the CPU at tiny sizes
#
# Every stage runs under `timeout`; a failed or timed-out stage is recorded
# in OUT_DIR/stages.tsv and results.md and the script goes on. Stages that
# would overrun the time budget are skipped and say so.
#
# Environment: PYTHON (default python3; must import torch), BUILD_DIR
# (default <repo>/build-gpu-check, wiped first unless KEEP_BUILD=1), JOBS
# (default nproc), BUDGET_S (default 450), ROUNDS_1 / ROUNDS_2 (benchmark
# rounds at 1 and 2 ranks, default 2 and 1), GPT_STEPS / GPT_WARMUP
# (default 15 / 5).

set -uo pipefail

usage() {
  sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
}

[[ $# -ge 1 && $1 != -h && $1 != --help ]] || usage
OUT=$1
shift
CPU_MODE=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --cpu) CPU_MODE=1 ;;
    *) echo "gpu_check: unknown option $1" >&2; usage ;;
  esac
  shift
done

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$OUT/logs" "$OUT/gpt"
OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-python3}
BUILD_DIR=${BUILD_DIR:-$ROOT/build-gpu-check}
JOBS=${JOBS:-$(nproc)}
BUDGET_S=${BUDGET_S:-450}
ROUNDS_1=${ROUNDS_1:-2}
ROUNDS_2=${ROUNDS_2:-1}
GPT_STEPS=${GPT_STEPS:-15}
GPT_WARMUP=${GPT_WARMUP:-5}
START=$(date +%s)
STAGES=$OUT/stages.tsv
printf 'stage\trc\tseconds\tnote\n' > "$STAGES"

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

# stage NAME TIMEOUT_S COMMAND...: runs COMMAND under timeout, logs to
# logs/NAME.log, records the outcome. Returns the command's status.
stage() {
  local name=$1 limit=$2
  shift 2
  local elapsed=$(($(date +%s) - START))
  if ((elapsed + 10 > BUDGET_S)); then
    log "SKIP $name: the ${BUDGET_S}s budget is spent (${elapsed}s)"
    printf '%s\t-\t0\tskipped: budget spent\n' "$name" >> "$STAGES"
    return 125
  fi
  # Never past the budget, however long the stage may take.
  ((limit > BUDGET_S - elapsed)) && limit=$((BUDGET_S - elapsed))
  log "RUN  $name (limit ${limit}s): $*"
  local t0 rc note=""
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
  rc=$?
  ((rc == 124 || rc == 137)) && note="timed out after ${limit}s"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" "$note" >> "$STAGES"
  if ((rc == 0)); then log "OK   $name"; else log "FAIL $name (rc $rc${note:+, $note}); see logs/$name.log"; tail -5 "$OUT/logs/$name.log"; fi
  return "$rc"
}

# ---------------------------------------------------------------------------
# What the machine has.
{
  echo "date: $(date -Is)"
  echo "host: $(uname -n) $(uname -srm)"
  echo "cores: $(nproc)"
  echo "mode: $([[ $CPU_MODE == 1 ]] && echo 'cpu (dry run)' || echo gpu)"
  if command -v nvidia-smi > /dev/null; then
    echo "gpus:"; nvidia-smi -L 2>&1 | sed 's/^/  /'
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/  /'
  else
    echo "gpus: nvidia-smi not found"
  fi
  echo "python: $PYTHON"
  "$PYTHON" -c 'import torch; print("torch:", torch.__version__, "cuda:", torch.version.cuda, "available:", torch.cuda.is_available(), "devices:", torch.cuda.device_count(), "nccl:", torch.cuda.nccl.version() if torch.cuda.is_available() else None)' 2>&1
  for tool in cmake g++ c++ ninja make ccache nvcc; do
    if command -v "$tool" > /dev/null; then echo "tool $tool: $(command -v "$tool") ($("$tool" --version 2>&1 | head -1))"; else echo "tool $tool: MISSING"; fi
  done
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

MISSING=()
command -v cmake > /dev/null || MISSING+=(cmake)
command -v c++ > /dev/null || command -v g++ > /dev/null || MISSING+=("a C++ compiler (g++)")
"$PYTHON" -c 'import torch' > /dev/null 2>&1 || MISSING+=("torch for $PYTHON")
if ((${#MISSING[@]})); then
  log "cannot build: missing ${MISSING[*]}"
  printf 'prerequisites\t1\t0\tmissing: %s\n' "${MISSING[*]}" >> "$STAGES"
fi
GENERATOR="Unix Makefiles"
command -v ninja > /dev/null && GENERATOR=Ninja
HAVE_GTEST=0
for dir in /usr/include /usr/local/include; do [[ -f $dir/gtest/gtest.h ]] && HAVE_GTEST=1; done
HAVE_ZLIB=0
for dir in /usr/include /usr/local/include; do [[ -f $dir/zlib.h ]] && HAVE_ZLIB=1; done
NOTES=()
[[ $HAVE_GTEST == 0 ]] && NOTES+=("googletest headers not found (libgtest-dev): tests not built, gpu tests skipped")
[[ $HAVE_ZLIB == 0 ]] && NOTES+=("zlib.h not found (zlib1g-dev): examples not built, Wine runs skipped")
[[ $GENERATOR != Ninja ]] && NOTES+=("ninja not found: using make")
for note in "${NOTES[@]}"; do log "NOTE $note"; done

# ---------------------------------------------------------------------------
# Build only what the check runs.
BUILT=0
IGNORED_FAILURES=(gpt_cpp_ddp_w2_nccl_probe_r0)
if ((${#MISSING[@]} == 0)); then
  [[ ${KEEP_BUILD:-0} == 1 ]] || rm -rf "$BUILD_DIR"
  TESTS=OFF EXAMPLES=OFF
  [[ $HAVE_GTEST == 1 ]] && TESTS=ON
  [[ $HAVE_ZLIB == 1 ]] && EXAMPLES=ON
  CONFIGURE=(cmake -S "$ROOT" -B "$BUILD_DIR" -G "$GENERATOR" -DDDP_PYTHON="$(command -v "$PYTHON")"
    "-DDDP_BUILD_TESTS=$TESTS" "-DDDP_BUILD_EXAMPLES=$EXAMPLES" -DDDP_BUILD_BENCH=ON)
  CONFIGURED=0
  if stage configure 180 "${CONFIGURE[@]}"; then
    CONFIGURED=1
    grep -E "^-- ddp:" "$OUT/logs/configure.log"
  else
    # A CUDA toolkit that torch's CMake config rejects (another CUDA version,
    # say): build against the CUDA headers of torch's wheel instead.
    rm -rf "$BUILD_DIR"
    if stage configure_without_toolkit 180 "${CONFIGURE[@]}" -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON; then
      CONFIGURED=1
      IGNORED_FAILURES+=(configure)
      grep -E "^-- ddp:" "$OUT/logs/configure_without_toolkit.log"
    fi
  fi
  if [[ $CONFIGURED == 1 ]]; then
    TARGETS=(ddprun gpt_bench)
    [[ $TESTS == ON ]] && TARGETS+=(gpu_worker fsdp_worker ddp_gpu_tests)
    [[ $EXAMPLES == ON ]] && TARGETS+=(wine_ddp)
    stage build 330 cmake --build "$BUILD_DIR" -j "$JOBS" --target "${TARGETS[@]}" && BUILT=1
  fi
fi
BIN=$BUILD_DIR/bin

# ---------------------------------------------------------------------------
# Tests labelled gpu (they skip, saying why, without CUDA).
if [[ $BUILT == 1 && $HAVE_GTEST == 1 ]]; then
  stage gpu_tests 240 ctest --test-dir "$BUILD_DIR" -L gpu --output-on-failure --timeout 200
  grep -E "tests passed|Skipped|Failed|\*\*\*" "$OUT/logs/gpu_tests.log" | tail -15
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
    grep -E "Test accuracy|error" "$OUT/logs/wine_${n}rank.log" | tail -3
    rm -rf "$dir"
  done
fi

# ---------------------------------------------------------------------------
# The GPT benchmark. Each run appends its JSON line, tagged, to
# gpt/runs.jsonl; configurations alternate within each round.
RUNS=$OUT/gpt/runs.jsonl
: > "$RUNS"

gpt_run() {  # gpt_run CONFIG ROUND LIMIT COMMAND...
  local config=$1 round=$2 limit=$3
  shift 3
  local name="gpt_${config}_r${round}"
  stage "$name" "$limit" "$@"
  local rc=$?
  local line
  line=$(grep -o '{"impl".*' "$OUT/logs/$name.log" | tail -1)
  if [[ $rc == 0 && -n $line ]]; then
    "$PYTHON" -c 'import json, sys; r = json.loads(sys.argv[1]); r.update(config=sys.argv[2], round=int(sys.argv[3])); print(json.dumps(r))' \
      "$line" "$config" "$round" >> "$RUNS"
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
  echo "$BACKEND2" > "$OUT/gpt/backend_w2.txt"
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
# The summary.
"$PYTHON" - "$OUT" "$CPU_MODE" "${NOTES[@]}" << 'PY'
import json, os, statistics, sys

out, cpu_mode, notes = sys.argv[1], sys.argv[2] == "1", sys.argv[3:]
env = open(os.path.join(out, "env.txt")).read()
stages = [line.rstrip("\n").split("\t") for line in open(os.path.join(out, "stages.tsv"))][1:]
runs = [json.loads(line) for line in open(os.path.join(out, "gpt", "runs.jsonl")) if line.strip()]

by_config = {}
for r in runs:
    if r["round"] > 0:
        by_config.setdefault(r["config"], []).append(r)
summary = {}
for config, rs in by_config.items():
    last = rs[-1]
    summary[config] = {
        "runs": len(rs), "step_ms_median": statistics.median(r["step_ms_median"] for r in rs),
        "step_ms_per_run": [r["step_ms_median"] for r in rs],
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
        "mfu": statistics.median(r["mfu"] for r in rs) if all(r["mfu"] is not None for r in rs) else None,
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
json.dump({"summary": summary, "ratios": ratios, "stages": stages, "notes": notes}, open(os.path.join(out, "results.json"), "w"), indent=1)

def f(x, fmt="{:.3f}"):
    return "n/a" if x is None else fmt.format(x)

lines = ["# GPU check results" + (" (CPU dry run, tiny model: not GPU figures)" if cpu_mode else ""), "",
         "```", env.strip(), "```", ""]
lines += [f"- note: {n}" for n in notes]
lines += ["", "## Stages", "", "| stage | exit | seconds | note |", "|---|---|---|---|"]
lines += [f"| {s[0]} | {s[1]} | {s[2]} | {s[3] if len(s) > 3 else ''} |" for s in stages]
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
                 f"{s['runs']} | {s['step_ms_median']:.2f} | {s['tokens_per_s']:.0f} | {f(s['mfu'], '{:.1%}')} | "
                 f"{s['loss_first']:.4f} -> {s['loss_last']:.4f} |")
lines += ["", "| ratio (step time) | value |", "|---|---|"]
lines += [f"| {k} | {f(v)} |" for k, v in ratios.items()]
backend_file = os.path.join(out, "gpt", "backend_w2.txt")
if os.path.exists(backend_file):
    lines += ["", f"Two ranks on one device used {open(backend_file).read().strip()}."]
open(os.path.join(out, "results.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY

# Failures that a later stage made up for (the NCCL probe, a configure
# retried without the toolkit) do not fail the check.
FAILED=$(awk -F'\t' -v ignored=" ${IGNORED_FAILURES[*]} " \
  'NR > 1 && $2 != "0" && $2 != "-" && index(ignored, " " $1 " ") == 0' "$STAGES" | cut -f1 | tr '\n' ' ')
log "done in $(($(date +%s) - START))s; results in $OUT/results.md"
if [[ -n $FAILED ]]; then
  log "failed stages: $FAILED"
  exit 1
fi
exit 0
