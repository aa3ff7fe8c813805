#!/usr/bin/env bash
# Everything a GPU run should check, as stages, and three planned calls of stages, each under
# its own time budget. Usage:
#
#   bash benchmarks/gpu_session.sh [--dry-run] CALL|STAGE [CALL|STAGE...]
#   bash benchmarks/gpu_session.sh --list     # the stages
#   bash benchmarks/gpu_session.sh --calls    # the calls: budget in seconds, then their stages
#
# Calls (one command each, most valuable first; each call's budget counts from its start,
# setup included; GPU_SESSION_BUDGET overrides it):
#   call1  (450 s) env calib snapshot frag: the wind tunnel's calibration table on CUDA, what
#          holds the device at a step's start under cpu, and fragmentation. Worth a session alone.
#   call2  (510 s) env maxseq-8b: the longest sequence an 8B-shaped model with LoRA trains.
#   call3  (510 s) env replay-exact gdb-engine tests sanitizer: the checks that need a GPU.
#   call4  (510 s) env projection-8b budgets: the 8B model's bytes per token projected to 32
#          blocks, and auto under budgets against the allocator's peak.
#
# Stages:
#   env           the header every benchmark prints (versions, GPU, file system, O_DIRECT, kvikio)
#   calib         7B-shaped, 4 layers, 8k and 32k: none, keep, torch_checkpoint, cpu, auto,
#                 torch_save_on_cpu, torch_checkpoint_cpu (auto decides from a warm step): the
#                 table `long_context.py --calibrate` compares the tunnel with
#   snapshot      cpu at 8k with torch.cuda.memory._snapshot() at the start of the first timed
#                 step: what holds the device's memory there, by the code that allocated it
#   frag          cpu and auto at 32k, caching allocator and +replay: peak reserved over peak
#                 allocated, actoff's device arena and the replay plan against their lower bounds
#   budgets       7B-shaped, 4 layers, 8k: every policy once, then auto under 3 budgets from keep's
#                 peak to the floor (the main run's question on CUDA): the budget asked against the
#                 peak the allocator counted, transients inside blocks included
#   projection-8b the 8B shape itself at 2 and 4 blocks, 96k and 128k, LoRA rank 16, six policies
#                 (auto at its floor), then benchmarks/projection.py on them: the measured bytes
#                 per token scaled to 32 blocks, the longest length on this GPU and the others
#   maxseq-8b     the longest sequence from 128k: 8B-shaped, a frozen base with rank-16 LoRA, 32
#                 layers emulated on 4 (a ballast and the host budget scaled by 4/32), for
#                 torch_checkpoint+tile+loss, recompute+tile+loss, cpu+tile+loss, auto+tile+loss;
#                 each probe's time limit sized from the last probe's time
#   replay-exact  the replay allocator's bit-exactness tests (keep and cpu)
#   gdb-engine    the NVMe engine and tier tests under cuda-gdb with the C++ engine (not kvikio):
#                 a native backtrace of every thread if the error paths crash
#   tests         the gpu-marked tests, then the NVMe and kvikio tests on the real disk
#   sanitizer     the gpu-marked tests under TORCH_CUDA_SANITIZER=1 (stream-ordering checker)
#   suite         the whole test suite (8 processes where pytest-xdist is there)
#   io            I/O bandwidth on the NVMe directory (engine, kvikio host and device buffers, pinned)
#   planner       planner benchmark (CPU work; run it only when a call has time to spare)
#
# Each command gets what is left of its call's budget (minus a margin) through `timeout`, and
# the benchmarks get less as --time-budget, so they stop starting work they could not finish.
# Everything is written as it is made: benchmarks append JSON lines (--jsonl), pytest prints a
# test's name before it runs (-v) and appends a JSON line when it starts and ends (--jsonl,
# tests/conftest.py), so a call cut short keeps what it measured and names what it was running.
# Setup (device, kvikio wheels, the extension's build, the header) goes to one file, setup.log.
# `--dry-run` prints every command (one per line, after "+ "), runs nothing and installs
# nothing: tests/test_benchmarks.py checks those commands against the benchmarks' parsers and
# pytest's markers on every CI run.
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
#   are in the GPU image. Optional: peft for --lora (else actoff's benchmark adapters), pulp highspy
#   for the planner tests.)
# Then copy the checkout with .whl/ to the GPU machine and run one call per command, e.g.
# `OUT=results bash benchmarks/gpu_session.sh call1`. Results land in $OUT (logs and JSON
# lines); commit the ones worth keeping under benchmarks/results/<device>-<date>/.
set -u

STAGES="env calib snapshot frag budgets projection-8b maxseq-8b replay-exact gdb-engine tests sanitizer suite io planner"
declare -A CALL_STAGES=(
  [call1]="env calib snapshot frag"
  [call2]="env maxseq-8b"
  [call3]="env replay-exact gdb-engine tests sanitizer"
  [call4]="env projection-8b budgets"
)
declare -A CALL_BUDGET=([call1]=450 [call2]=510 [call3]=510 [call4]=510)

dry_run=0
groups=()   # "NAME BUDGET STAGE..." per call; plain stages form a group of their own
plain=()
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    --list) echo "$STAGES"; exit 0 ;;
    --calls) for call in call1 call2 call3 call4; do echo "$call ${CALL_BUDGET[$call]} ${CALL_STAGES[$call]}"; done; exit 0 ;;
    -*) echo "unknown option $arg" >&2; exit 2 ;;
    call*)
      [ -n "${CALL_STAGES[$arg]:-}" ] || { echo "unknown call $arg: call1 call2 call3 call4" >&2; exit 2; }
      groups+=("$arg ${GPU_SESSION_BUDGET:-${CALL_BUDGET[$arg]}} ${CALL_STAGES[$arg]}") ;;
    *)
      case " $STAGES " in *" $arg "*) ;; *) echo "unknown stage $arg: $STAGES" >&2; exit 2 ;; esac
      plain+=("$arg") ;;
  esac
done
[ ${#plain[@]} -gt 0 ] && groups+=("stages ${GPU_SESSION_BUDGET:-540} ${plain[*]}")
[ ${#groups[@]} -gt 0 ] || { echo "usage: $0 [--dry-run] CALL|STAGE... (--calls, --list name them)" >&2; exit 2; }

cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/actoff-gpu-out}
# Not ACTOFF_*: actoff refuses unknown ACTOFF_ settings, and the benchmarks inherit the environment.
margin_s=20
started_s=$(date +%s)  # the first call's clock starts before setup: setup is part of its budget
budget_s=540
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
    echo "   skipped: the call's budget is spent" | tee -a "$OUT/$log"
    return 0
  fi
  timeout --signal=TERM --kill-after=10 "$seconds" env "$@" 2>&1 | tee -a "$OUT/$log" | tail -40
  local status=${PIPESTATUS[0]}
  [ "$status" = 124 ] && echo "   stopped at the deadline ($seconds s); what it wrote so far is in $OUT/$log"
  return 0
}

# What a benchmark gets as --time-budget: less than its command's timeout, so that it ends
# its worker processes itself (a timeout stops only the process it started); at most $1 when
# given, so that the stages after it in the call keep their share.
inner_budget() {
  local seconds=$(( $(left) - 30 ))
  if [ $# -gt 0 ] && [ "$1" -lt "$seconds" ]; then seconds=$1; fi
  [ "$seconds" -gt 1 ] || seconds=1
  echo "$seconds"
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

# The host budget of a whole model for the longest-sequence search: 60% of the memory available
# now (an emulated run scales it by its built layers over the model's: Note [emulated layers]).
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
  {
    echo "== setup $(date -u +%FT%TZ), revision $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  } >>"$OUT/setup.log" 2>&1
  # Wheels carried in .whl/ (kvikio and what it needs), into a folder on PYTHONPATH: no network,
  # no change to the image's Python.
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl >>"$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
  fi
  export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  # The extension in place (pybind11 only, seconds): no pip, no editable install.
  if ! python3 -c "import actoff._C" 2>/dev/null; then
    python3 setup.py -q build_ext --inplace >>"$OUT/setup.log" 2>&1 || { tail -30 "$OUT/setup.log"; exit 1; }
  fi
  head -2 "$OUT/setup.log"
else
  echo "# dry run: nothing is installed or run"
fi

# pytest, verbose (a test's name before it runs), its JSON lines to $OUT/$1.jsonl.
pytest_cmd() {
  echo python3 -m pytest -v -p no:cacheprovider -rfE --jsonl "$OUT/$1.jsonl"
}

stage() {
  local name=$1
  echo "== stage $name ($(left) s left)"
  case "$name" in
    env)  # the header every benchmark prints, into the setup log
      run setup.log python3 benchmarks/_common.py --header "$NVME_DIR" ;;
    calib)  # the slow baselines last: the H100 run has them; a cut call loses them first
      run calib.log python3 benchmarks/long_context.py --preset 7b --layers 4 --seq 8k,32k --steps 3 --warmup 1 \
        --policies none,keep,torch_checkpoint,cpu,auto,torch_save_on_cpu,torch_checkpoint_cpu \
        --nvme-dir "$NVME_DIR" --timeout 100 --time-budget "$(inner_budget 250)" \
        --jsonl "$OUT/calib.jsonl" --plot "$OUT/calib.png" ;;
    snapshot)  # its own process: recording the allocator's stacks slows it, so it is not timed
      run snapshot.log python3 benchmarks/long_context.py --preset 7b --layers 4 --seq 8k --steps 1 --warmup 1 \
        --policies cpu --memory-snapshot "$OUT/snapshot" --timeout 90 --time-budget "$(inner_budget 50)" \
        --jsonl "$OUT/snapshot.jsonl" ;;
    frag)
      run frag.log python3 benchmarks/long_context.py --preset 7b --layers 4 --seq 32k --steps 2 --warmup 1 \
        --policies cpu,cpu+replay,auto,auto+replay --timeout 100 --time-budget "$(inner_budget)" \
        --jsonl "$OUT/frag.jsonl" ;;
    budgets)  # auto's budgets are the main run's (Note [auto in the main run]); all CUDA's to split
      run budgets.log python3 benchmarks/long_context.py --preset 7b --layers 4 --seq 8k --steps 3 --warmup 1 \
        --policies none,keep,torch_checkpoint,torch_save_on_cpu,cpu,checkpoint,auto --auto-budgets 3 \
        --timeout 60 --time-budget "$(inner_budget)" --jsonl "$OUT/budgets.jsonl" --plot "$OUT/budgets.png" ;;
    projection-8b)  # ACTOFF_GPU_BUDGET below every plan: auto's least-memory plan. 96k and 128k:
      # at 16k and 32k every policy's peak is the loss's, not a block's (results/h200-2026-12-04/);
      # a checkpoint's block passes the loss's ~6.8 GiB + 33 KB a token near 64k. Most wanted first.
      for layers in 2 4; do
        run projection-8b.log ACTOFF_GPU_BUDGET=1MiB python3 benchmarks/long_context.py --preset 8b \
          --layers "$layers" --lora 16 --seq 96k,128k --steps 1 --warmup 1 --auto-budgets 0 \
          --policies chunked+tile+loss,torch_checkpoint_cpu+tile+loss,auto+tile+loss,cpu+tile+loss,torch_checkpoint+tile+loss,torch_save_on_cpu+tile+loss \
          --timeout 120 --time-budget "$(inner_budget 200)" --jsonl "$OUT/projection-8b-l$layers.jsonl"
      done
      run projection-8b.log python3 benchmarks/projection.py "$OUT/projection-8b-l2.jsonl" \
        "$OUT/projection-8b-l4.jsonl" --shrink 1 --json "$OUT/projection-8b.json" ;;
    maxseq-8b)
      run maxseq-8b.log ACTOFF_HOST_BUDGET="$(host_budget)" python3 benchmarks/long_context.py --preset 8b \
        --layers 4 --emulate-layers 32 --lora 16 --seq 128k --find-max-seq --max-seq 1024k \
        --policies torch_checkpoint+tile+loss,recompute+tile+loss,cpu+tile+loss,auto+tile+loss \
        --nvme-dir "$NVME_DIR" --timeout 300 --time-budget "$(inner_budget)" \
        --jsonl "$OUT/maxseq-8b.jsonl" --plot "$OUT/maxseq-8b.png" ;;
    replay-exact)
      run replay-exact.log $(pytest_cmd replay-exact) -m gpu -k bit_exact tests/memory/test_replay_steps.py ;;
    gdb-engine)  # the C++ engine: ACTOFF_IO_BACKEND=posix, which the tests keep (tests/conftest.py)
      run gdb-engine.log ACTOFF_IO_BACKEND=posix cuda-gdb -q -batch -ex "set pagination off" -ex run \
        -ex "thread apply all bt 12" --args $(pytest_cmd gdb-engine) tests/tiers/nvme/test_engines.py \
        tests/tiers/nvme/test_nvme.py ;;
    tests)
      run tests.log $(pytest_cmd tests) -m gpu tests
      run tests.log $(pytest_cmd tests) tests/tiers/nvme/test_nvme.py tests/tiers/nvme/test_engines.py \
        tests/tiers/nvme/test_kvikio.py tests/memory/test_host_arena.py ;;
    sanitizer)
      run sanitizer.log TORCH_CUDA_SANITIZER=1 $(pytest_cmd sanitizer) -m gpu tests ;;
    suite)  # in 8 processes where pytest-xdist is there (the GPU image has it): the CPU tests dominate
      workers=(); python3 -c "import xdist" 2>/dev/null && workers=(-n 8)
      run suite.log $(pytest_cmd suite) -p no:benchmark "${workers[@]}" tests ;;
    io)
      run io.log python3 benchmarks/io_bandwidth.py --size 4GiB --repeats 2 --dir "$NVME_DIR/io" --jsonl "$OUT/io.jsonl" ;;
    planner)
      run planner.log python3 benchmarks/planner.py --time-limit 10 --json "$OUT/planner.json" ;;
  esac
}

first=1
for group in "${groups[@]}"; do
  read -r name budget stages_of_group <<<"$group"
  budget_s=$budget
  [ "$first" = 1 ] || started_s=$(date +%s)  # a later call's clock starts at its own start
  first=0
  echo "== $name: budget $budget_s s ($(left) s left)"
  for name in $stages_of_group; do
    stage "$name"
  done
done
[ "$dry_run" = 1 ] || rm -rf "$NVME_DIR/io"
