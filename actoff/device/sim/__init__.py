"""The simulated asynchronous device: CUDA's stream semantics run on a CPU.

- `device`: its settings and stream API (`SimStreams`), and the `RaceError` it raises.
- `streams`: side streams whose queues worker threads run late; the compute stream.
- `memory`: poison for bytes a copy has not written yet; live and peak device bytes.
- `link`: the host link's two directions at a set rate (the wind tunnel: copies take the time
  they would take on a GPU with the same copy-to-compute ratio).
"""
