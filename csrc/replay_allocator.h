// actoff plan-replaying allocator core: static offsets for a repeating allocation sequence.
//
// Contract
// - What: during a recorded step, every request is served by the fallback allocator and
//   logged (size, allocation time, free time on a logical clock). Given a plan (the size and
//   offset of each request of the step) and one arena, later steps serve request k at
//   arena + offset[k]. A request whose size differs from the plan's, that comes after the
//   plan's end, or whose planned range still holds a live buffer (a lifetime longer than
//   traced), is served by the fallback allocator instead and counted as a divergence: never
//   an overlap.
// - Thread-safety: all methods may be called from any thread (one mutex).
// - Errors: deallocate() of an address this allocator never handed out throws
//   std::invalid_argument; set_plan() with mismatched lengths or offsets past the arena
//   throws std::invalid_argument.
// - The core knows no device: the fallback functions and the arena pointer decide whether
//   it manages host memory (the tests) or device memory (a CUDA pluggable allocator).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace actoff {

class ReplayAllocator {
 public:
  using AllocFn = std::function<void*(std::size_t)>;
  using FreeFn = std::function<void(void*, std::size_t)>;
  struct Event {
    std::size_t size;
    std::int64_t start;
    std::int64_t end;  // -1 while live
  };
  struct Stats {
    std::size_t served = 0;      // requests served from the arena
    std::size_t diverged = 0;    // requests that fell back while a plan was set
    std::size_t fallback = 0;    // all requests served by the fallback allocator
    std::size_t live = 0;        // buffers handed out and not yet freed
  };

  ReplayAllocator(AllocFn fallback_alloc, FreeFn fallback_free);
  ~ReplayAllocator();

  void begin_record();               // start logging a step's requests (clears the log)
  std::vector<Event> end_record();   // stop logging; the log in request order
  void set_plan(const std::vector<std::size_t>& sizes, const std::vector<std::size_t>& offsets,
                void* arena, std::size_t arena_bytes);
  void clear_plan();
  void begin_step();                 // request counter back to 0 for the next step
  void* allocate(std::size_t size);
  void deallocate(void* pointer);
  Stats stats() const;

 private:
  bool range_free(std::size_t offset, std::size_t size) const;

  AllocFn fallback_alloc_;
  FreeFn fallback_free_;
  mutable std::mutex mutex_;
  bool recording_ = false;
  std::int64_t clock_ = 0;
  std::vector<Event> log_;
  std::vector<std::size_t> plan_sizes_, plan_offsets_;
  char* arena_ = nullptr;
  std::size_t arena_bytes_ = 0;
  std::size_t next_request_ = 0;
  std::map<std::size_t, std::size_t> live_planned_;  // offset -> end, inside the arena
  // pointer -> (size, log index or -1, from arena)
  std::unordered_map<void*, std::tuple<std::size_t, std::int64_t, bool>> live_;
  Stats stats_;
};

}  // namespace actoff
