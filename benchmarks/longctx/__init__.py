"""The long-context benchmark, run by ``benchmarks/long_context.py``: a module per question.

- `cli`: the command line (presets, checks) and ``main``, which answers one of:
- `table`: the long-context table, every policy over the sequence lengths;
- `paired`: the ratio lines under it, from step times interleaved in one process on a CPU;
- `maxseq`: ``--find-max-seq``, the longest sequence each policy trains;
- `plots`: ``--plot``, for the table or the search;

and what they share:

- `policies`: the policies and their variants, and applying one to a model;
- `worker`: a worker process per policy (`run_one` starts it, `worker` runs in it);
- `measure`: one sequence length measured inside a worker, the record's fields;
- `ddp`: the torchrun mode (a record per rank, and their total).
"""
