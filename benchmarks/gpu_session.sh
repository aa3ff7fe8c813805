#!/usr/bin/env bash
# Everything a lent GPU should check, in few device calls (each stage fits in one 10-minute call).
#
# Before the first call, here (a machine with the package registries), fetch the wheels the GPU
# image lacks into .whl/ (ignored by git) and carry it:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl kvikio-cu13 libkvikio-cu13 rapids-logger cuda-pathfinder \
#     nvidia-cufile pulp highspy
# Then, with the device tool (carry [".whl"]):
#   bash benchmarks/gpu_session.sh tests      # build, gpu-marked tests, then the whole suite
#   bash benchmarks/gpu_session.sh io         # I/O bandwidth (engine, kvikio GDS or compat, pinned copies)
#   bash benchmarks/gpu_session.sh long       # 7B-shaped long-context table and plot
#   bash benchmarks/gpu_session.sh maxseq     # longest trainable sequence per policy
#   bash benchmarks/gpu_session.sh planner    # planner benchmark
# Results land in $OUT (the device tool brings them back); commit them under
# benchmarks/results/<device>-<date>/.
set -u
stage=${1:-tests}
OUT=${OUT:-/tmp/actoff-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
if ! python3 -c "import actoff._C" 2>/dev/null; then
  python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
case "$stage" in
  tests)
    python3 -m pytest -q -m gpu -rA tests 2>&1 | tee "$OUT/pytest-gpu.log" | tail -40
    python3 -m pytest -q -x tests 2>&1 | tee "$OUT/pytest-all.log" | tail -5 ;;
  io)
    python3 benchmarks/io_bandwidth.py --size 4GiB --dir /tmp/actoff-io --json "$OUT/io_bandwidth.json" 2>&1 \
      | tee "$OUT/io_bandwidth.txt" | tail -40 ;;
  long)
    python3 benchmarks/long_context.py --preset 7b --layers 4 --seq 8k,16k,32k --steps 3 --warmup 1 \
      --policies keep,checkpoint,save_on_cpu,cpu,nvme,tokenwise:0.5:0,recompute,auto,recompute+verify \
      --json "$OUT/long_context.json" --plot "$OUT/long_context.png" 2>&1 | tee "$OUT/long_context.txt" | tail -40 ;;
  maxseq)
    python3 benchmarks/long_context.py --preset 7b --layers 4 --seq 8k --find-max-seq --max-seq 512k \
      --policies keep,checkpoint,cpu,auto --timeout 240 --json "$OUT/max_seq.json" 2>&1 | tee "$OUT/max_seq.txt" | tail -20 ;;
  planner)
    python3 benchmarks/planner.py --json "$OUT/planner.json" 2>&1 | tee "$OUT/planner.txt" | tail -30 ;;
  *)
    echo "unknown stage $stage: tests, io, long, maxseq or planner"; exit 2 ;;
esac
