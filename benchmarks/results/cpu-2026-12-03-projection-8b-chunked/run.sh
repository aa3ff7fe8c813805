# From the repository root, a clean tree: the 8B proxy under chunked at 2 and 4 blocks, then the projection.
set -e
D=benchmarks/results/cpu-2026-12-03-projection-8b-chunked
for L in 2 4; do
  ACTOFF_CHUNK_TOKENS=128 python benchmarks/long_context.py --preset 8b --shrink 32 --layers $L --lora 4 \
    --seq 4k,8k --steps 1 --warmup 1 --policies chunked+tile+loss --sim-memory 4GiB \
    --jsonl $D/proxy-l$L.jsonl > $D/proxy-l$L.log 2>&1
done
python benchmarks/projection.py $D/proxy-l2.jsonl $D/proxy-l4.jsonl \
  benchmarks/results/cpu-2026-11-28-projection-8b/proxy-l2.jsonl benchmarks/results/cpu-2026-11-28-projection-8b/proxy-l4.jsonl \
  --shrink 32 --json $D/projection.json > $D/projection.txt 2>&1
