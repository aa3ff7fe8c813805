// The replay allocator on CUDA: the C entry points of libactoff_replay.so.
//
// torch's CUDAPluggableAllocator calls actoff_replay_malloc / actoff_replay_free for every CUDA
// tensor once actoff.memory.replay_allocator has installed it; actoff's Python side drives the windows and
// plans through the control entry points below (ctypes). The logic is the device-agnostic core
// (replay_allocator.h); this file gives it cudaMallocAsync / cudaFreeAsync on the request's
// stream as the fallback, CUDA events as fences, and cudaMalloc'd arenas.
//
// Contract
// - No C++ exception crosses the C ABI: every entry point catches everything, records the
//   message (actoff_replay_error) and returns NULL or -1. Errors are counted; the first since
//   the last clear is kept.
// - actoff_replay_malloc returns NULL for 0 bytes (torch never frees a null data pointer) and
//   on failure. torch does not check a pluggable allocator's result, so Python raises the
//   recorded error at its next check (the end of the step).
// - One core per device (0..63), created on first use and kept for the life of the process
//   (tensors may be freed during interpreter shutdown).
// - Thread-safety: every entry point may be called from any thread.
// - Linked with the static CUDA runtime: loading the library needs no libcudart, and nothing
//   here touches CUDA until a request or a plan arrives.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "replay_allocator.h"

#define ACTOFF_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using actoff::ReplayAllocator;
using Stream = ReplayAllocator::Stream;

constexpr int kMaxDevices = 64;
constexpr int kAbiVersion = 1;
constexpr std::size_t kArenaGranularity = std::size_t{2} << 20;  // 2 MiB, like cudaMalloc's

// The order of the values actoff_replay_stats writes; Python reads the names from here.
constexpr const char* kStatNames =
    "served,diverged,occupied,unplanned,outside,fallback,failed,waits,plans,live,live_bytes,"
    "peak_bytes,fallback_bytes,arena_bytes,peak_reserved_bytes";

std::mutex error_mutex;
std::string first_error;
std::size_t error_count = 0;

void record_error(const std::string& message) noexcept {
  try {
    std::lock_guard<std::mutex> lock(error_mutex);
    if (error_count++ == 0) first_error = message;
  } catch (...) {
    // Out of memory while recording: the count is all that is left.
  }
}

std::string cuda_message(const char* what, cudaError_t status) {
  (void)cudaGetLastError();  // clear a non-sticky error so the next call starts clean
  return std::string(what) + " failed: " + cudaGetErrorName(status) + " (" + cudaGetErrorString(status) + ")";
}

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(cuda_message(what, status));
}

// Makes `device` current for the call and restores the caller's device after it.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) {
      check(cudaSetDevice(device), "cudaSetDevice");
      switched_ = true;
    }
  }
  ~DeviceGuard() {
    if (switched_) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
  bool switched_ = false;
};

struct DeviceState {
  explicit DeviceState(int index);

  int device;
  ReplayAllocator core;
  std::vector<ReplayAllocator::Event> log;  // of the last window, until copied out
  void* arena = nullptr;
  std::size_t arena_bytes = 0;
  std::vector<cudaEvent_t> spare_events;  // used under the core's lock only
  bool pool_configured = false;           // likewise
};

void* fallback_alloc(DeviceState& state, std::size_t size, Stream stream) {
  if (!state.pool_configured) {
    // Note [fallback pool]: freed fallback memory stays in the device's default pool (release
    // threshold UINT64_MAX, not the default 0) rather than going back to the driver at every
    // synchronisation, which would make every fallback a driver allocation. A plan trims the
    // pool before it takes its arena, or the process would hold the step twice: in the pool
    // and in the arena.
    state.pool_configured = true;
    cudaMemPool_t pool = nullptr;
    std::uint64_t keep = UINT64_MAX;
    if (cudaDeviceGetDefaultMemPool(&pool, state.device) != cudaSuccess ||
        cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep) != cudaSuccess) {
      (void)cudaGetLastError();  // an unconfigured pool still serves, only slower
    }
  }
  void* pointer = nullptr;
  const cudaError_t status = cudaMallocAsync(&pointer, size, reinterpret_cast<cudaStream_t>(stream));
  if (status != cudaSuccess) {
    // (No figures from the core here: this runs under its lock.)
    record_error(cuda_message("cudaMallocAsync", status) + " for " + std::to_string(size) +
                 " bytes on device " + std::to_string(state.device));
    return nullptr;
  }
  return pointer;
}

DeviceState::DeviceState(int index)
    : device(index),
      core([this](std::size_t size, Stream stream) { return fallback_alloc(*this, size, stream); },
           [this](void* pointer, std::size_t, Stream stream) {
             const cudaError_t status = cudaFreeAsync(pointer, reinterpret_cast<cudaStream_t>(stream));
             if (status != cudaSuccess) {
               record_error(cuda_message("cudaFreeAsync", status) + " on device " + std::to_string(device));
             }
           }) {
  ReplayAllocator::Fences fences;
  fences.record = [this](Stream stream) -> void* {
    cudaEvent_t event = nullptr;
    if (!spare_events.empty()) {
      event = spare_events.back();
      spare_events.pop_back();
    } else {
      const cudaError_t status = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
      if (status != cudaSuccess) {
        record_error(cuda_message("cudaEventCreateWithFlags", status));
        return nullptr;
      }
    }
    const cudaError_t status = cudaEventRecord(event, reinterpret_cast<cudaStream_t>(stream));
    if (status != cudaSuccess) {
      record_error(cuda_message("cudaEventRecord", status));
      spare_events.push_back(event);
      return nullptr;
    }
    return event;
  };
  fences.passed = [](void* fence) {
    const cudaError_t status = cudaEventQuery(static_cast<cudaEvent_t>(fence));
    if (status == cudaSuccess) return true;
    if (status == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    record_error(cuda_message("cudaEventQuery", status));
    return true;  // a broken event would otherwise be waited for forever
  };
  fences.wait = [](Stream stream, void* fence) {
    const cudaError_t status =
        cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(fence), 0);
    if (status != cudaSuccess) record_error(cuda_message("cudaStreamWaitEvent", status));
  };
  fences.release = [this](void* fence) { spare_events.push_back(static_cast<cudaEvent_t>(fence)); };
  core.set_fences(std::move(fences));
  core.set_arena_released([this](void* old_arena) {
    // A retired arena whose last buffer is gone. Rare (a plan that needed a larger arena):
    // synchronise so no queued kernel still touches it.
    cudaError_t status = cudaDeviceSynchronize();
    if (status == cudaSuccess) status = cudaFree(old_arena);
    if (status != cudaSuccess) record_error(cuda_message("cudaFree of a retired arena", status));
  });
}

std::array<std::atomic<DeviceState*>, kMaxDevices> states{};
std::mutex states_mutex;

DeviceState& device_state(int device) {
  if (device < 0 || device >= kMaxDevices) {
    throw std::invalid_argument("device " + std::to_string(device) + " is out of range 0.." +
                                std::to_string(kMaxDevices - 1));
  }
  DeviceState* state = states[device].load(std::memory_order_acquire);
  if (state == nullptr) {
    std::lock_guard<std::mutex> lock(states_mutex);
    state = states[device].load(std::memory_order_relaxed);
    if (state == nullptr) {
      state = new DeviceState(device);  // never deleted: see the contract
      states[device].store(state, std::memory_order_release);
    }
  }
  return *state;
}

// Runs `body` and turns any exception into a recorded error and -1.
template <typename Body>
int guarded(const char* entry, int device, Body&& body) noexcept {
  try {
    body();
    return 0;
  } catch (const std::exception& error) {
    record_error(std::string(entry) + "(device " + std::to_string(device) + "): " + error.what());
  } catch (...) {
    record_error(std::string(entry) + "(device " + std::to_string(device) + "): unknown error");
  }
  return -1;
}

}  // namespace

// ---------------------------------------------------------------- the allocator pair

ACTOFF_EXPORT void* actoff_replay_malloc(std::size_t size, int device, cudaStream_t stream) {
  if (size == 0) return nullptr;
  void* pointer = nullptr;
  guarded("actoff_replay_malloc", device, [&] {
    DeviceState& state = device_state(device);
    DeviceGuard guard(device);
    pointer = state.core.allocate(size, reinterpret_cast<Stream>(stream));
  });
  return pointer;
}

ACTOFF_EXPORT void actoff_replay_free(void* pointer, std::size_t size, int device, cudaStream_t stream) {
  (void)size;    // the core knows each buffer's size
  (void)stream;  // and the stream it was allocated on (torch passes that one)
  if (pointer == nullptr) return;
  guarded("actoff_replay_free", device, [&] {
    DeviceState& state = device_state(device);
    DeviceGuard guard(device);
    state.core.deallocate(pointer);
  });
}

// ---------------------------------------------------------------- control (0 or -1)

ACTOFF_EXPORT int actoff_replay_abi_version(void) { return kAbiVersion; }

ACTOFF_EXPORT const char* actoff_replay_stat_names(void) { return kStatNames; }

// Can this library's (static) CUDA runtime use the driver? Writes both versions (0: none) and
// returns the number of devices, or -1 with the error recorded. Creates no context.
ACTOFF_EXPORT int actoff_replay_check_driver(int* driver_version, int* runtime_version) {
  *driver_version = 0;
  *runtime_version = 0;
  (void)cudaRuntimeGetVersion(runtime_version);
  (void)cudaDriverGetVersion(driver_version);
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    record_error(cuda_message("cudaGetDeviceCount", status));
    return -1;
  }
  return count;
}

// Open a window with no plan: every request falls back and is logged.
ACTOFF_EXPORT int actoff_replay_begin_record(int device) {
  return guarded("actoff_replay_begin_record", device, [&] { device_state(device).core.begin_record(); });
}

// Open a window under the current plan.
ACTOFF_EXPORT int actoff_replay_begin_step(int device) {
  return guarded("actoff_replay_begin_step", device, [&] { device_state(device).core.begin_step(); });
}

// Close the window; its log is kept for actoff_replay_copy_log. Returns the number of
// requests logged, or -1.
ACTOFF_EXPORT long long actoff_replay_end_step(int device) {
  long long count = -1;
  guarded("actoff_replay_end_step", device, [&] {
    DeviceState& state = device_state(device);
    state.log = state.core.end_step();
    count = static_cast<long long>(state.log.size());
  });
  return count;
}

// Copy the last window's log (count must be what actoff_replay_end_step returned).
ACTOFF_EXPORT int actoff_replay_copy_log(int device, unsigned long long* sizes, long long* starts,
                                         long long* ends, std::size_t count) {
  return guarded("actoff_replay_copy_log", device, [&] {
    DeviceState& state = device_state(device);
    if (count != state.log.size()) {
      throw std::invalid_argument("asked for " + std::to_string(count) + " entries, the log has " +
                                  std::to_string(state.log.size()));
    }
    for (std::size_t k = 0; k < count; ++k) {
      sizes[k] = state.log[k].size;
      starts[k] = state.log[k].start;
      ends[k] = state.log[k].end;
    }
  });
}

// Serve the next windows from this plan (offset ~0 = unplanned). The arena is taken with
// cudaMalloc when the plan needs more than the current one (2 MiB granularity), after the
// fallback pool is trimmed; a smaller plan reuses the current arena.
ACTOFF_EXPORT int actoff_replay_set_plan(int device, const unsigned long long* sizes,
                                         const unsigned long long* offsets, std::size_t count,
                                         unsigned long long arena_bytes) {
  return guarded("actoff_replay_set_plan", device, [&] {
    DeviceState& state = device_state(device);
    std::vector<std::size_t> plan_sizes(sizes, sizes + count);
    std::vector<std::size_t> plan_offsets(offsets, offsets + count);
    if (arena_bytes > state.arena_bytes) {
      DeviceGuard guard(device);
      state.core.clear_plan();  // until the new arena is in place, everything falls back
      // The recorded window's memory goes back to the driver first (Note [fallback pool]).
      check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      cudaMemPool_t pool = nullptr;
      check(cudaDeviceGetDefaultMemPool(&pool, device), "cudaDeviceGetDefaultMemPool");
      check(cudaMemPoolTrimTo(pool, 0), "cudaMemPoolTrimTo");
      const std::size_t bytes = (arena_bytes + kArenaGranularity - 1) / kArenaGranularity * kArenaGranularity;
      void* arena = nullptr;
      const cudaError_t status = cudaMalloc(&arena, bytes);
      if (status != cudaSuccess) {
        throw std::runtime_error(cuda_message("cudaMalloc", status) + " for a replay arena of " +
                                 std::to_string(bytes) + " bytes");
      }
      state.core.set_plan(plan_sizes, plan_offsets, arena, bytes);  // retires the old arena
      state.arena = arena;
      state.arena_bytes = bytes;
    } else {
      state.core.set_plan(plan_sizes, plan_offsets, state.arena, state.arena_bytes);
    }
  });
}

ACTOFF_EXPORT int actoff_replay_clear_plan(int device) {
  return guarded("actoff_replay_clear_plan", device, [&] { device_state(device).core.clear_plan(); });
}

// Write the figures named by actoff_replay_stat_names, in that order (count of them).
ACTOFF_EXPORT int actoff_replay_stats(int device, unsigned long long* values, std::size_t count) {
  return guarded("actoff_replay_stats", device, [&] {
    const ReplayAllocator::Stats s = device_state(device).core.stats();
    const std::size_t all[] = {s.served,     s.diverged,       s.occupied,    s.unplanned,
                               s.outside,    s.fallback,       s.failed,      s.waits,
                               s.plans,      s.live,           s.live_bytes,  s.peak_bytes,
                               s.fallback_bytes, s.arena_bytes, s.peak_reserved_bytes};
    if (count != sizeof(all) / sizeof(all[0])) {
      throw std::invalid_argument("asked for " + std::to_string(count) + " figures, there are " +
                                  std::to_string(sizeof(all) / sizeof(all[0])));
    }
    std::copy(all, all + count, values);
  });
}

ACTOFF_EXPORT int actoff_replay_reset_peak(int device) {
  return guarded("actoff_replay_reset_peak", device, [&] { device_state(device).core.reset_peak(); });
}

// Errors recorded since the last clear: returns their number and copies the first message
// (NUL-terminated, truncated to capacity). clear != 0 forgets them.
ACTOFF_EXPORT std::size_t actoff_replay_error(char* buffer, std::size_t capacity, int clear) {
  std::lock_guard<std::mutex> lock(error_mutex);
  const std::size_t count = error_count;
  if (buffer != nullptr && capacity > 0) {
    const std::size_t length = std::min(first_error.size(), capacity - 1);
    std::memcpy(buffer, first_error.data(), length);
    buffer[length] = '\0';
  }
  if (clear != 0) {
    error_count = 0;
    first_error.clear();
  }
  return count;
}
