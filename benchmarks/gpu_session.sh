#!/usr/bin/env bash
# Everything a GPU run should check, as stages under one time budget. Usage:
#
#   bash benchmarks/gpu_session.sh [--dry-run] STAGE [STAGE...]
#   bash benchmarks/gpu_session.sh --list
#
# Stages (several may share one call; they share its time):
#   env            versions, the GPU, the NVMe directory's file system, O_DIRECT, kvikio GDS or compat
#   tests          the gpu-marked tests, then the NVMe and kvikio tests on the real disk
#   sanitizer      the gpu-marked tests under TORCH_CUDA_SANITIZER=1 (stream-ordering checker)
#   io-gdb         the I/O and NVMe tests under cuda-gdb (a native backtrace if they crash)
#   suite          the whole test suite, stopped at the deadline
#   io             I/O bandwidth on the NVMe directory (engine, kvikio host and device buffers, pinned)
#   long           7B-shaped long-context table and plot (4 layers, 8k and 32k, every policy, cpu+tile+loss)
#   maxseq-base    longest trainable sequence without actoff and with checkpointing
#   maxseq-actoff  longest trainable sequence under actoff's cpu and auto policies, with tiling and chunked loss
#   alloc          fragmentation (reserved minus allocated at the peak) at 8k and 32k under cpu+tile+loss
#                  for four allocators: PyTorch's caching allocator (+noplan), expandable segments,
#                  actoff's planned device arena (the default), actoff's replay allocator (+replay)
#   maxseq-alloc   longest trainable sequence for the same four
#   planner        planner benchmark (CPU work; run it only when a call has time to spare)
#
# The stages of one invocation share GPU_SESSION_BUDGET seconds (default 540) counted from
# the start; each command gets what is left (minus a margin) through `timeout`, and the
# benchmarks get it as --time-budget, so they stop starting work they could not finish.
# Records are written as they are made (--jsonl), so a stage cut short keeps what it measured.
# `--dry-run` prints every command a stage would run (one per line, after "+ "), runs nothing
# and installs nothing: tests/test_benchmarks.py checks those commands against the benchmarks'
# parsers on every CI run.
#
# The script works without network access, and where pip's editable install is refused: the
# package is used in place (PYTHONPATH=$PWD, extension built with setup.py build_ext --inplace)
# and kvikio comes as wheels carried in .whl/. Before the first call, here (a machine with the
# package registries):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl kvikio-cu13==26.10.0 libkvikio-cu13==26.10.0 \
#     rapids-logger==0.3.0 cuda-pathfinder==1.9.0
#   (about 4 MB, checked 2026-11; kvikio's other needs, cupy-cuda13x, numpy and cuda-toolkit[cufile],
#   are in the GPU image. Optional, for the planner tests: add pulp highspy.)
# Then copy the checkout with .whl/ to the GPU machine and run, e.g.,
# `OUT=results bash benchmarks/gpu_session.sh env tests`. Results land in $OUT (logs and JSON
# lines); commit the ones worth keeping under benchmarks/results/<device>-<date>/.
set -u

dry_run=0
stages=()
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    --list) echo "env tests sanitizer io-gdb suite io long maxseq-base maxseq-actoff alloc maxseq-alloc planner"; exit 0 ;;
    -*) echo "unknown option $arg" >&2; exit 2 ;;
    *) stages+=("$arg") ;;
  esac
done
[ ${#stages[@]} -gt 0 ] || { echo "usage: $0 [--dry-run] STAGE... (--list names them)" >&2; exit 2; }

cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/actoff-gpu-out}
# Not ACTOFF_*: actoff refuses unknown ACTOFF_ settings, and the benchmarks inherit the environment.
budget_s=${GPU_SESSION_BUDGET:-540}
margin_s=20
started_s=$(date +%s)
export PYTHONUNBUFFERED=1

left() {  # seconds a command may still run
  local spent=$(( $(date +%s) - started_s ))
  echo $(( budget_s - spent - margin_s ))
}

# run LOG CMD...: print the command; unless --dry-run, run it under timeout, output to $OUT/LOG.
run() {
  local log=$1; shift
  echo "+ $(printf '%q ' "$@")"
  [ "$dry_run" = 1 ] && return 0
  local seconds; seconds=$(left)
  if [ "$seconds" -le 10 ]; then
    echo "   skipped: the session budget is spent" | tee -a "$OUT/$log"
    return 0
  fi
  timeout --signal=TERM --kill-after=10 "$seconds" env "$@" 2>&1 | tee -a "$OUT/$log" | tail -40
  local status=${PIPESTATUS[0]}
  [ "$status" = 124 ] && echo "   stopped at the deadline ($seconds s); what it wrote so far is in $OUT/$log"
  return 0
}

# What a benchmark gets as --time-budget: less than its command's timeout, so that it ends
# its worker processes itself (a timeout stops only the process it started).
inner_budget() {
  echo $(( $(left) - 30 ))
}

# A directory on a real disk for the NVMe tier (never tmpfs: that is RAM).
pick_nvme_dir() {
  local candidate kind
  for candidate in ${ACTOFF_NVME_DIR:-} /var/tmp/actoff-nvme "$PWD/.nvme" /tmp/actoff-nvme; do
    [ -n "$candidate" ] || continue
    mkdir -p "$candidate" 2>/dev/null && [ -w "$candidate" ] || continue
    kind=$(stat -f -c %T "$candidate" 2>/dev/null)
    case "$kind" in tmpfs|ramfs) continue ;; esac
    echo "$candidate"; return
  done
  echo /tmp/actoff-nvme
}

# A real host budget for the longest-sequence search: 60% of the memory available now.
host_budget() {
  local kib; kib=$(awk '/^MemAvailable:/ {print $2}' /proc/meminfo 2>/dev/null)
  [ -n "$kib" ] || { echo "32GiB"; return; }
  echo "$(( kib * 6 / 10 / 1048576 ))GiB"
}

if [ "$dry_run" = 1 ]; then
  NVME_DIR=${ACTOFF_NVME_DIR:-/var/tmp/actoff-nvme}  # not looked for: a dry run touches nothing
else
  NVME_DIR=$(pick_nvme_dir)
fi
export ACTOFF_TEST_NVME_DIR=$NVME_DIR

if [ "$dry_run" = 0 ]; then
  mkdir -p "$OUT"
  # Wheels carried in .whl/ (kvikio and what it needs), into a folder on PYTHONPATH: no network,
  # no change to the image's Python.
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
  fi
  export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  # The extension in place (pybind11 only, seconds): no pip, no editable install.
  if ! python3 -c "import actoff._C" 2>/dev/null; then
    python3 setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
else
  echo "# dry run: nothing is installed or run"
fi

# The four allocators the alloc stages compare, under one actoff policy.
ALLOCATORS=cpu+tile+loss+noplan,cpu+tile+loss+noplan+expandable,cpu+tile+loss,cpu+tile+loss+replay

for stage in "${stages[@]}"; do
  echo "== stage $stage ($(left) s left)"
  case "$stage" in
    env)  # the header every benchmark prints: versions, GPU, file system, O_DIRECT, kvikio GDS or compat
      run env.log python3 benchmarks/_common.py --header "$NVME_DIR" ;;
    tests)
      run tests.log python3 -m pytest -q -p no:cacheprovider -rA -m gpu tests
      run tests.log python3 -m pytest -q -p no:cacheprovider -rA tests/tiers/nvme/test_nvme.py tests/tiers/nvme/test_engines.py tests/tiers/nvme/test_kvikio.py tests/memory/test_host_arena.py ;;
    sanitizer)
      run sanitizer.log TORCH_CUDA_SANITIZER=1 python3 -m pytest -q -p no:cacheprovider -rA -m gpu tests ;;
    io-gdb)  # the I/O tests under cuda-gdb: a native backtrace of every thread if one crashes
      run io-gdb.log cuda-gdb -q -batch -ex "set pagination off" -ex run -ex "thread apply all bt 12" \
        --args python3 -m pytest -q -p no:cacheprovider tests/tiers/nvme/test_engines.py tests/tiers/nvme/test_nvme.py ;;
    suite)  # in 8 processes where pytest-xdist is there (the GPU image has it): the CPU tests dominate
      workers=(); python3 -c "import xdist" 2>/dev/null && workers=(-n 8)
      # -v: one line per test as it ends, so a run cut at the deadline still names its failures.
      run suite.log python3 -m pytest -v -p no:cacheprovider -p no:benchmark -rfE "${workers[@]}" tests ;;
    io)
      run io.log python3 benchmarks/io_bandwidth.py --size 4GiB --repeats 2 --dir "$NVME_DIR/io" --jsonl "$OUT/io.jsonl" ;;
    long)
      run long.log python3 benchmarks/long_context.py --preset 7b --layers 4 --seq 8k,32k --steps 3 --warmup 1 \
        --policies none,keep,torch_checkpoint,torch_save_on_cpu,cpu,nvme,tokenwise:0.5:0,recompute,auto,cpu+tile+loss \
        --nvme-dir "$NVME_DIR" --timeout 150 --time-budget "$(inner_budget)" \
        --jsonl "$OUT/long.jsonl" --plot "$OUT/long.png" ;;
    maxseq-base|maxseq-actoff)
      policies=none,torch_checkpoint
      [ "$stage" = maxseq-actoff ] && policies=cpu+tile+loss,auto+tile+loss
      run "$stage.log" ACTOFF_HOST_BUDGET="$(host_budget)" python3 benchmarks/long_context.py --preset 7b --layers 4 \
        --seq 16k --find-max-seq --max-seq 512k --policies "$policies" --nvme-dir "$NVME_DIR" --timeout 120 \
        --time-budget "$(inner_budget)" --jsonl "$OUT/$stage.jsonl" ;;
    alloc)
      run alloc.log python3 benchmarks/long_context.py --preset 7b --layers 4 --seq 8k,32k --steps 3 --warmup 1 \
        --policies "$ALLOCATORS" --nvme-dir "$NVME_DIR" --timeout 150 --time-budget "$(inner_budget)" \
        --jsonl "$OUT/alloc.jsonl" ;;
    maxseq-alloc)
      run maxseq-alloc.log ACTOFF_HOST_BUDGET="$(host_budget)" python3 benchmarks/long_context.py --preset 7b \
        --layers 4 --seq 16k --find-max-seq --max-seq 512k --policies "$ALLOCATORS" --nvme-dir "$NVME_DIR" \
        --timeout 120 --time-budget "$(inner_budget)" --jsonl "$OUT/maxseq-alloc.jsonl" ;;
    planner)
      run planner.log python3 benchmarks/planner.py --time-limit 10 --json "$OUT/planner.json" ;;
    *)
      echo "unknown stage $stage: $(bash "$0" --list)" >&2; exit 2 ;;
  esac
done
[ "$dry_run" = 1 ] || rm -rf "$NVME_DIR/io"
