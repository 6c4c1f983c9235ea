#!/usr/bin/env bash
# The checks of one session on a lent GPU, in one device call, packed for the trip back.
#
#   bash ci/gpu_checks.sh                       # on the GPU machine; OUT: the folder that comes back
#   MICRO_ROWS="16 32 64" bash ci/gpu_checks.sh # the micro-batch sizes to bench (default: 32 64)
#   SKIP=pytest,profile bash ci/gpu_checks.sh   # leave steps out (pytest, bench, profile)
#   PATH=.nox/tests/bin:$PATH BENCH_ARGS="--model tiny --device cpu --rows 4 --prompt-len 8 --response-len 8" \
#     SIDES=update-verity-compiled PROFILE_SIDES=update-verity-compiled SKIP=pytest MICRO_ROWS=2 \
#     OUT=/tmp/g bash ci/gpu_checks.sh                                   # a dry run on a CPU (about a minute)
#
# Steps, each under its own time limit, each line of $OUT/summary.txt saying its exit code and
# seconds: the `gpu` tests (`tests/unit/test_engine_gpu.py`); `ci/bench_gpu.py` once per
# micro-batch size with the compiled layers and the CUDA-graph side in the same process (so their
# ratio is measured side by side); one profiled CUDA-graph step (kernel table, device gaps) with
# inductor's performance hints logged. Everything lands in $OUT/gpu-checks/ and is packed into
# $OUT/gpu-checks.tar.gz: the device tool brings back only a handful of files per call, and a
# session on 2026-11-27 lost its profile to that limit. About 7-8 minutes on an H200 with the
# defaults (the CUDA-graph side's first step compiles and records for about a minute).
# The packages the GPU image lacks come from ../shared/gpu/build-site.sh .gpu (carried as .gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder whose files come back}"
out="$OUT/gpu-checks"
mkdir -p "$out"
if [ -f .gpu/site.tar.xz ] && [ ! -d .gpu/site ]; then
  mkdir -p .gpu/site && tar -xJf .gpu/site.tar.xz -C .gpu/site
fi
export PYTHONPATH="$PWD/.gpu/site:$PWD/packages/verity/src${PYTHONPATH:+:$PYTHONPATH}"
export MLFLOW_ALLOW_FILE_STORE=true PYTHONUNBUFFERED=1
skip=",${SKIP:-},"
sides="${SIDES:-update-verity-compiled,update-verity-cudagraphs}"
read -r -a bench_args <<< "${BENCH_ARGS:-}"

run_step() {  # name, seconds allowed, command...: its output to $out/name.log, a line to summary.txt
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(( $(date +%s) - start ))s" | tee -a "$out/summary.txt"
}

{
  command -v nvidia-smi > /dev/null && nvidia-smi \
    --query-gpu=name,memory.total,driver_version,power.limit,clocks.max.sm --format=csv
  python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
} > "$out/machine.txt" 2>&1
if [[ $skip != *,pytest,* ]]; then
  run_step pytest-gpu 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_engine_gpu.py
fi
if [[ $skip != *,bench,* ]]; then
  for rows in ${MICRO_ROWS:-32 64}; do
    run_step "bench-micro$rows" 240 python3 ci/bench_gpu.py "${bench_args[@]}" --micro-rows "$rows" \
      --warmup 3 --steps 5 --sides "$sides" --out "$out/bench-micro$rows.json"
  done
fi
if [[ $skip != *,profile,* ]]; then
  TORCH_LOGS=perf_hints run_step profile 180 python3 ci/bench_gpu.py "${bench_args[@]}" \
    --micro-rows "${PROFILE_MICRO_ROWS:-16}" --warmup 3 --steps 1 --profile "$out/profile" \
    --sides "${PROFILE_SIDES:-update-verity-cudagraphs}" --out "$out/profile.json"
  rm -f "$out"/profile/*.trace.json.gz  # tens of MiB each: over what comes back
fi
cp "$out/summary.txt" "$OUT/summary.txt" 2> /dev/null
tar -czf "$OUT/gpu-checks.tar.gz" -C "$OUT" gpu-checks && rm -rf "$out"
