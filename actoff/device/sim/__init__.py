"""The simulated asynchronous device: CUDA's stream semantics run on a CPU.

- `device`: its settings and stream API (`SimStreams`), and the `RaceError` it raises.
- `streams`: side streams whose queues worker threads run late; the compute stream.
- `memory`: poison for bytes a copy has not written yet; live and peak device bytes.
"""
