"""The long-context benchmark, run by ``benchmarks/long_context.py``: a module per question.

- `cli`: ``main``, which answers one of the questions below; `options`: its presets and options;
- `table`: the long-context table, every policy over the sequence lengths;
- `paired`: the ratio lines under it, from step times interleaved in one process on a CPU;
- `maxseq`: ``--find-max-seq``, the longest sequence each policy trains;
- `budgets`: ``--budgets N``, every policy under device budgets from keep's peak to the floor;
- `calibrate`: ``--calibrate``, the wind tunnel against a GPU run;
- `plots`: ``--plot``, for the table or the search;

and what they share:

- `policies`: the policies and their variants, and applying one to a model;
- `worker`: a worker process per policy (`run_one` starts it, `worker` runs in it);
- `measure`: one sequence length measured inside a worker, the record's fields;
- `warmup`: the worker's warm-up steps, and under ``auto`` the steps until its plan holds;
- `tunnel`: the wind tunnel, the simulated device's link scaled to a GPU's copy-to-compute ratio;
- `emulate`: ``--emulate-layers``, a deep model stood for by a few blocks and a ballast;
- `lora`: ``--lora``, a frozen base with trainable adapters;
- `snapshot`: ``--memory-snapshot``, what holds a CUDA device's memory;
- `ddp`: the torchrun mode (a record per rank, and their total).
"""
