#!/bin/bash
# device call 1: CUDA graphs for the compiled layers, measured beside the compiled layers without them
cd "$(dirname "$0")/.."
start=$(date +%s)
mkdir -p .gpu/site && tar -xJf .gpu/site.tar.xz -C .gpu/site
export PYTHONPATH=$PWD/.gpu/site:$PWD/packages/verity/src MLFLOW_ALLOW_FILE_STORE=true PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,power.limit,clocks.max.sm --format=csv > $OUT/nvidia-smi.csv
python3 -c "import torch,transformers,triton;print(torch.__version__,transformers.__version__,triton.__version__)" > $OUT/versions.txt 2>&1
echo "unpacked $(( $(date +%s)-start ))s"
TORCH_LOGS=perf_hints timeout 240 python3 ci/bench_gpu.py --out $OUT/bench16.json --warmup 3 --steps 6 \
  --sides update-verity-compiled,update-verity-cudagraphs,update-torch-compiled > $OUT/bench16.log 2>&1
echo "bench16 rc=$? $(( $(date +%s)-start ))s"; tail -8 $OUT/bench16.log
timeout 120 python3 ci/bench_gpu.py --out $OUT/bench64.json --micro-rows 64 --warmup 3 --steps 4 \
  --sides update-verity-cudagraphs > $OUT/bench64.log 2>&1
echo "bench64 rc=$? $(( $(date +%s)-start ))s"; tail -4 $OUT/bench64.log
timeout 120 python3 ci/bench_gpu.py --out $OUT/bench32.json --micro-rows 32 --warmup 3 --steps 4 \
  --sides update-verity-cudagraphs > $OUT/bench32.log 2>&1
echo "bench32 rc=$? $(( $(date +%s)-start ))s"; tail -4 $OUT/bench32.log
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_engine_gpu.py > $OUT/pytest-gpu.log 2>&1
echo "pytest rc=$? $(( $(date +%s)-start ))s"; tail -5 $OUT/pytest-gpu.log
timeout 100 python3 ci/bench_gpu.py --out $OUT/bench16-profile.json --warmup 3 --steps 2 --profile $OUT/profile \
  --sides update-verity-cudagraphs > $OUT/bench16-profile.log 2>&1
echo "profile rc=$? $(( $(date +%s)-start ))s"; tail -3 $OUT/bench16-profile.log
rm -f $OUT/profile/*.trace.json.gz
