#!/usr/bin/env bash
# The checks of one session on a lent GPU, in one device call, packed for the trip back.
#
#   bash ci/gpu_checks.sh                       # on the GPU machine; OUT: the folder that comes back
#   MICRO_ROWS="32 64" bash ci/gpu_checks.sh    # the micro-batch sizes to bench (default: 64 rows where the
#                                               # GPU has >= 120 GiB, else 32: 64 took 99 GiB on an H200)
#   SDPA_BACKENDS="flash efficient" bash ...    # the CUDA-graph side again with only that SDPA kernel
#   SKIP=pytest,profile bash ci/gpu_checks.sh   # leave steps out (pytest, head, bench, sdpa, profile)
#   PATH=.nox/tests/bin:$PATH BENCH_ARGS="--model tiny --device cpu --rows 4 --prompt-len 8 --response-len 8" \
#     SIDES=update-verity-compiled ONE_SIDE=update-verity-compiled SKIP=pytest,head SDPA_BACKENDS=math \
#     MICRO_ROWS=2 PROFILE_MICRO_ROWS=2 OUT=/tmp/g bash ci/gpu_checks.sh   # a dry run on a CPU (about a minute)
#
# Steps, each under its own time limit, each line of $OUT/summary.txt saying its exit code and
# seconds, the update's MFU first: `ci/bench_gpu.py` once per micro-batch size with the CUDA-graph
# side and the compiled side without graphs one after the other, each in a fresh process
# (`--process-per-side`: in one process a second side can run out of memory beside the first
# one's CUDA-graph pools), their ratio in one JSON; the loss
# head's kernels side by side
# (`ci/bench_gpu_head.py`: Triton at several blocks and warps, the previous Triton forward,
# inductor's, plain PyTorch); the CUDA-graph side once more per SDPA kernel in SDPA_BACKENDS
# (default: flash; torch's own choice on an H200 is cuDNN's), at the first micro-batch size; the
# `gpu` tests (`tests/unit/test_engine_gpu.py`); one profiled CUDA-graph step (kernel
# table, device gaps) with inductor's performance hints and its CUDA-graph logs (which operation
# splits a graph, which inputs are copied into it). Each step writes to a scratch gpu-checks/ that is
# packed into $OUT/gpu-checks.tar.gz after every step: the device tool brings back only a
# handful of files per call (a session on 2026-11-27 lost its profile to that limit) and stops a
# call at 600 s, so each step's limit is cut to what is left of TOTAL_S (default 570 s) and a
# step with under 30 s left is skipped, saying so. About 9 minutes on an H200 with the defaults
# (each CUDA-graph side's first step compiles and records for about a minute).
# The packages the GPU image lacks come from ../shared/gpu/build-site.sh .gpu (carried as .gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder whose files come back}"
out="$(mktemp -d)/gpu-checks"  # the steps write here; $OUT holds only the archive and summary.txt
mkdir -p "$out" "$OUT"
deadline=$(( $(date +%s) + ${TOTAL_S:-570} ))  # the device tool stops a call at 600 s
if [ -f .gpu/site.tar.xz ] && [ ! -d .gpu/site ]; then
  mkdir -p .gpu/site && tar -xJf .gpu/site.tar.xz -C .gpu/site
fi
export PYTHONPATH="$PWD/.gpu/site:$PWD/packages/verity/src:$PWD/packages/toyworld/src${PYTHONPATH:+:$PYTHONPATH}"
# not pip-installed here, so the toy world's entry point is named directly (model.path=embedded, tiny models)
export VERITY_PLUGINS="verity_toyworld.plugin:register${VERITY_PLUGINS:+,$VERITY_PLUGINS}"
export MLFLOW_ALLOW_FILE_STORE=true PYTHONUNBUFFERED=1
skip=",${SKIP:-},"
sides="${SIDES:-update-verity-cudagraphs,update-verity-compiled}"  # the bench step's sides
one_side="${ONE_SIDE:-update-verity-cudagraphs}"  # the side of the sdpa and profile steps
read -r -a bench_args <<< "${BENCH_ARGS:-}"

pack() {  # $OUT/gpu-checks.tar.gz and summary.txt as they stand: a call cut short still brings back what ran
  cp "$out/summary.txt" "$OUT/summary.txt" 2> /dev/null
  tar -czf "$OUT/gpu-checks.tar.gz" --exclude='*.trace.json.gz' -C "$(dirname "$out")" gpu-checks
}

run_step() {  # name, seconds allowed, command...: its output to $out/name.log, a line to summary.txt
  local name=$1 limit=$2 start rc left
  shift 2
  start=$(date +%s)
  left=$(( deadline - start ))
  if (( left < 30 )); then
    echo "$name skipped: ${left}s left of TOTAL_S" | tee -a "$out/summary.txt"
    pack
    return
  fi
  (( limit > left )) && limit=$left
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(( $(date +%s) - start ))s" | tee -a "$out/summary.txt"
  pack
}

{
  command -v nvidia-smi > /dev/null && nvidia-smi \
    --query-gpu=name,memory.total,driver_version,power.limit,clocks.max.sm --format=csv
  python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
} > "$out/machine.txt" 2>&1
if [ -z "${MICRO_ROWS:-}" ]; then  # 64-row micro-batches need ~100 GiB: an H200, not an H100
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2> /dev/null | head -1)
  [[ $mib =~ ^[0-9]+$ ]] || mib=0  # no nvidia-smi, or "[N/A]": the smaller size
  MICRO_ROWS=$(( mib >= 122880 ? 64 : 32 ))
  echo "micro-batch rows: $MICRO_ROWS (GPU memory: $mib MiB, 0: unknown)" >> "$out/machine.txt"
fi
read -r -a micro_rows <<< "$MICRO_ROWS"
if [[ $skip != *,bench,* ]]; then
  for rows in "${micro_rows[@]}"; do
    run_step "bench-micro$rows" 300 python3 -m ci.bench_gpu "${bench_args[@]}" --micro-rows "$rows" \
      --warmup 3 --steps 5 --sides "$sides" --process-per-side --out "$out/bench-micro$rows.json"
  done
fi
if [[ $skip != *,head,* ]]; then
  run_step head 90 python3 -m ci.bench_gpu_head --out "$out/head.json"
fi
if [[ $skip != *,sdpa,* ]]; then
  for backend in ${SDPA_BACKENDS:-flash}; do
    run_step "sdpa-$backend-micro${micro_rows[0]}" 150 python3 -m ci.bench_gpu "${bench_args[@]}" \
      --micro-rows "${micro_rows[0]}" --warmup 3 --steps 5 --sdpa-backend "$backend" \
      --sides "$one_side" --out "$out/sdpa-$backend-micro${micro_rows[0]}.json"
  done
fi
if [[ $skip != *,pytest,* ]]; then
  run_step pytest-gpu 180 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_engine_gpu.py
fi
if [[ $skip != *,profile,* ]]; then
  logs=perf_hints,cudagraphs,cudagraph_static_inputs
  TORCH_LOGS=$logs python3 -c "import torch" 2> /dev/null || logs=perf_hints  # an older torch lacks one
  TORCH_LOGS=$logs run_step profile 180 python3 -m ci.bench_gpu "${bench_args[@]}" \
    --micro-rows "${PROFILE_MICRO_ROWS:-${micro_rows[0]}}" --warmup 3 --steps 1 --profile "$out/profile" \
    --sides "$one_side" --out "$out/profile.json"  # its traces (tens of MiB each) stay out of the archive
fi
pack
rm -rf "$(dirname "$out")"
