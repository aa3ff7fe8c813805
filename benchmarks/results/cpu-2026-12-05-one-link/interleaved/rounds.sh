#!/bin/bash
P=keep,torch_checkpoint,recompute,torch_save_on_cpu,auto
for r in 1 2 3 4; do  # run as two invocations of rounds 1-2 and 3-4
  for t in new old; do
    if [ $t = old ]; then export PYTHONPATH=/tmp/oldwt; D=/tmp/oldwt; else unset PYTHONPATH; D=/work/main; fi
    (cd $D && python benchmarks/long_context.py --seq 1024 --policies $P --json /tmp/cmp-$t-$r.json > /tmp/cmp-$t-$r.log 2>&1)
    echo "$t $r done $(date -u +%T)"
  done
done
