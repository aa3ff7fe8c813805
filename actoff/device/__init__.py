"""Device backends behind one interface: host buffers, copies off the compute stream, tickets.

Nothing above this package asks "is this CUDA?": `base.backend_for` returns the backend of a
device, and the backend answers every question that differs between devices.

- `base`: the interface (`DeviceBackend`, `Ticket`), the plain CPU backend and the stream
  backend that CUDA and the simulated device share.
- `cuda`: CUDA's streams, events and pinned memory for the stream backend.
- `sim`: the simulated asynchronous device: CUDA's stream semantics on a CPU, with a race
  checker and a device memory count (`actoff.testing.simulated_device`).
"""
