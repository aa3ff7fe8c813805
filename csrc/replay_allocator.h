// actoff plan-replaying allocator core: static offsets for a repeating allocation sequence.
//
// Contract
// - What: requests are numbered inside a window (begin_step ... end_step; one training step).
//   Every window is logged (size, allocation and free time on a logical clock; free time -1
//   when the buffer outlived the window). begin_record opens a window with no plan: every
//   request is served by the fallback allocator. Given a plan (per request of a window: its
//   size and an offset into one arena, or kUnplanned) later windows serve request k at
//   arena + offset[k]. Outside a window, and for requests planned kUnplanned (they outlived
//   the window they were planned from), the fallback serves by design.
// - Divergence, never an overlap:
//   Note [divergence]: a request whose size differs from the plan's, or past the plan's end,
//   is served by the fallback and counted as diverged: the sequence changed, so the caller
//   plans again from this window's log. A request whose planned range still holds a live
//   buffer (a lifetime longer than traced) is served by the fallback and counted as occupied.
//   Either way no request gets bytes a live buffer holds.
//   Note [skippable]: an unplanned entry whose size does not match is skipped, so a one-time
//   allocation of the planned window (a library workspace made on first use) does not shift
//   every later request.
// - Stream safety (set_fences; without fences a freed range is reusable at once, as on host
//   memory): freeing an arena buffer records a fence on the stream it was allocated on (the
//   only stream known to use it: a pluggable allocator gets no record_stream). A request on
//   that stream may reuse the range at once (the stream runs in order); a request on another
//   stream whose fence has not passed is made to wait for it (no host stall), and counted.
// - Arenas belong to the caller. set_plan with another arena retires the current one: its
//   live buffers stay valid, and arena_released(base) is called once the last of them is
//   freed (at once when none is live).
// - Thread-safety: every method may be called from any thread (one mutex). The callbacks
//   (fallback, fences, arena_released) run under it and must not call back into this object.
// - Errors: deallocate() of an address this allocator never handed out throws
//   std::invalid_argument; set_plan() with mismatched lengths or offsets past the arena
//   throws std::invalid_argument. A fallback that returns null is counted as failed and the
//   request returns null (the caller reports it).
// - The core knows no device: the fallback, the fences and the arena pointer decide whether
//   it manages host memory (the tests) or device memory (csrc/replay_cuda.cu).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace actoff {

class ReplayAllocator {
 public:
  using Stream = std::uintptr_t;  // a cudaStream_t on CUDA; any tag on the host
  using AllocFn = std::function<void*(std::size_t, Stream)>;
  using FreeFn = std::function<void(void*, std::size_t, Stream)>;
  struct Fences {
    std::function<void*(Stream)> record;        // a fence after the work queued on the stream
    std::function<bool(void*)> passed;          // has its stream passed it? (never blocks)
    std::function<void(Stream, void*)> wait;    // make a stream wait for it (no host stall)
    std::function<void(void*)> release;         // give it back
  };
  struct Event {
    std::size_t size;
    std::int64_t start;
    std::int64_t end;  // -1 while live
  };
  struct Stats {
    std::size_t served = 0;     // requests served from the arena
    std::size_t diverged = 0;   // fell back: another size, or past the plan's end
    std::size_t occupied = 0;   // fell back: the planned range still held a live buffer
    std::size_t unplanned = 0;  // fell back by plan: outlived the window it was planned from
    std::size_t outside = 0;    // requests outside any window
    std::size_t fallback = 0;   // all requests the fallback allocator served
    std::size_t failed = 0;     // the fallback returned null
    std::size_t waits = 0;      // reuses of a range freed on another stream that had to wait
    std::size_t plans = 0;      // plans set
    std::size_t live = 0;       // buffers handed out and not yet freed
    std::size_t live_bytes = 0;
    std::size_t peak_bytes = 0;           // most bytes handed out at once
    std::size_t fallback_bytes = 0;       // live bytes from the fallback
    std::size_t arena_bytes = 0;          // arenas in use: the current one and retired ones
    std::size_t peak_reserved_bytes = 0;  // most (arena_bytes + fallback_bytes) at once
  };
  static constexpr std::size_t kUnplanned = std::numeric_limits<std::size_t>::max();

  ReplayAllocator(AllocFn fallback_alloc, FreeFn fallback_free);
  ~ReplayAllocator();

  void set_fences(Fences fences);
  void set_arena_released(std::function<void(void*)> callback);

  void begin_record();             // drop the plan, then begin_step
  std::vector<Event> end_record(); // same as end_step
  void begin_step();               // open a window: request counter 0, a fresh log
  std::vector<Event> end_step();   // close it; its log in request order
  void set_plan(const std::vector<std::size_t>& sizes, const std::vector<std::size_t>& offsets,
                void* arena, std::size_t arena_bytes);
  void clear_plan();               // keep the arena; every request falls back
  void* allocate(std::size_t size, Stream stream = 0);
  void deallocate(void* pointer);
  Stats stats() const;
  void reset_peak();               // peaks back to the current figures

 private:
  struct Live {
    std::size_t size;
    std::int64_t index;  // into log_, or -1
    char* arena;         // the arena it came from, or null (fallback)
    Stream stream;
  };
  struct Pending {  // a freed arena range, reusable by its own stream, by others after a fence
    std::size_t offset, end;
    Stream stream;
    void* fence;
  };
  bool range_free(std::size_t offset, std::size_t size) const;
  void order_after_frees(std::size_t offset, std::size_t size, Stream stream);
  void release_arena(char* arena);
  void drop_pending();
  void forget_log_indices();
  void note_reserved();

  AllocFn fallback_alloc_;
  FreeFn fallback_free_;
  Fences fences_;
  std::function<void(void*)> arena_released_;
  mutable std::mutex mutex_;
  bool window_ = false;
  std::int64_t clock_ = 0;
  std::vector<Event> log_;
  std::vector<std::size_t> plan_sizes_, plan_offsets_;
  char* arena_ = nullptr;
  std::size_t arena_size_ = 0;
  std::size_t next_request_ = 0;
  std::map<std::size_t, std::size_t> live_planned_;  // offset -> end, in the current arena
  std::vector<Pending> pending_;
  std::size_t sweep_at_ = 64;
  std::unordered_map<char*, std::pair<std::size_t, std::size_t>> retired_;  // live, bytes
  std::unordered_map<void*, Live> live_;
  Stats stats_;
};

}  // namespace actoff
