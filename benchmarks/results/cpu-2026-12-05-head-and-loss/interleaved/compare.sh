#!/bin/bash
OUT=${OUT:-.}  # where the records go; /tmp/old: a clone at 00fc958
# auto under the main run's budgets at 1024 tokens, the head+loss scope (924dc14) against the blocks only (00fc958), interleaved
for round in 1 2 3; do
  for head in new old; do
    dir=/work/main; [ $head = old ] && dir=/tmp/old
    (cd $dir && python benchmarks/long_context.py --policies keep,torch_save_on_cpu,auto --seq 1024 --json $OUT/$head-$round.json > $OUT/$head-$round.log 2>&1)
  done
done
