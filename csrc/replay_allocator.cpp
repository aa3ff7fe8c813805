// Implementation of the plan-replaying allocator core; the contract is in replay_allocator.h.
#include "replay_allocator.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace actoff {

ReplayAllocator::ReplayAllocator(AllocFn fallback_alloc, FreeFn fallback_free)
    : fallback_alloc_(std::move(fallback_alloc)), fallback_free_(std::move(fallback_free)) {}

ReplayAllocator::~ReplayAllocator() {
  // Return what the fallback still holds and the fences; arena memory belongs to the caller.
  for (auto& [pointer, info] : live_) {
    if (info.arena == nullptr) fallback_free_(pointer, info.size, info.stream);
  }
  drop_pending();
}

void ReplayAllocator::set_fences(Fences fences) {
  std::lock_guard<std::mutex> lock(mutex_);
  drop_pending();
  fences_ = std::move(fences);
}

void ReplayAllocator::set_arena_released(std::function<void(void*)> callback) {
  std::lock_guard<std::mutex> lock(mutex_);
  arena_released_ = std::move(callback);
}

void ReplayAllocator::begin_record() {
  clear_plan();
  begin_step();
}

std::vector<ReplayAllocator::Event> ReplayAllocator::end_record() { return end_step(); }

void ReplayAllocator::begin_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  forget_log_indices();  // buffers of an earlier window no longer point into the log
  window_ = true;
  clock_ = 0;
  log_.clear();
  next_request_ = 0;
}

std::vector<ReplayAllocator::Event> ReplayAllocator::end_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  window_ = false;
  forget_log_indices();
  return std::move(log_);
}

void ReplayAllocator::forget_log_indices() {
  for (auto& [pointer, info] : live_) info.index = -1;
}

void ReplayAllocator::set_plan(const std::vector<std::size_t>& sizes,
                               const std::vector<std::size_t>& offsets, void* arena,
                               std::size_t arena_bytes) {
  if (sizes.size() != offsets.size()) {
    throw std::invalid_argument("set_plan: " + std::to_string(sizes.size()) + " sizes but " +
                                std::to_string(offsets.size()) + " offsets");
  }
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    if (offsets[k] != kUnplanned && offsets[k] + sizes[k] > arena_bytes) {
      throw std::invalid_argument("set_plan: request " + std::to_string(k) + " ends at " +
                                  std::to_string(offsets[k] + sizes[k]) + ", past the arena of " +
                                  std::to_string(arena_bytes) + " bytes");
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  char* next = static_cast<char*>(arena);
  if (next != arena_) {
    // Retire the current arena: its live buffers stay where they are until freed.
    char* old = arena_;
    if (old != nullptr) {
      std::size_t still = 0;
      for (auto& [pointer, info] : live_) still += info.arena == old;
      retired_[old] = {still, arena_size_};
    }
    live_planned_.clear();
    drop_pending();  // ranges of the old arena are never handed out again
    arena_ = next;
    arena_size_ = arena_bytes;
    stats_.arena_bytes += arena_bytes;
    if (old != nullptr && retired_[old].first == 0) release_arena(old);
  } else {
    stats_.arena_bytes += arena_bytes - arena_size_;
    arena_size_ = arena_bytes;
  }
  plan_sizes_ = sizes;
  plan_offsets_ = offsets;
  next_request_ = 0;
  ++stats_.plans;
  note_reserved();
}

void ReplayAllocator::clear_plan() {
  std::lock_guard<std::mutex> lock(mutex_);
  plan_sizes_.clear();
  plan_offsets_.clear();
  next_request_ = 0;
}

void ReplayAllocator::release_arena(char* arena) {
  stats_.arena_bytes -= retired_[arena].second;
  retired_.erase(arena);
  if (arena_released_) arena_released_(arena);
}

void ReplayAllocator::drop_pending() {
  if (fences_.release) {
    for (auto& pending : pending_) fences_.release(pending.fence);
  }
  pending_.clear();
}

bool ReplayAllocator::range_free(std::size_t offset, std::size_t size) const {
  auto after = live_planned_.lower_bound(offset);
  if (after != live_planned_.end() && after->first < offset + size) return false;
  if (after != live_planned_.begin()) {
    auto before = std::prev(after);
    if (before->second > offset) return false;
  }
  return true;
}

void ReplayAllocator::order_after_frees(std::size_t offset, std::size_t size, Stream stream) {
  // Note [stream-safe reuse]: a range freed on stream A holds A's work until A passes the
  // fence; B may use it only after that. Passed fences are dropped here, or in a sweep of
  // all of them once there are many.
  const bool sweep = pending_.size() >= sweep_at_;
  std::size_t kept = 0;
  for (std::size_t i = 0; i < pending_.size(); ++i) {
    Pending& pending = pending_[i];
    const bool overlaps = pending.offset < offset + size && offset < pending.end;
    bool drop = false;
    if (overlaps || sweep) {
      drop = fences_.passed(pending.fence);
      if (!drop && overlaps && pending.stream != stream) {
        fences_.wait(stream, pending.fence);
        ++stats_.waits;
      }
    }
    if (drop) {
      fences_.release(pending.fence);
    } else {
      pending_[kept++] = pending;
    }
  }
  pending_.resize(kept);
  if (sweep) sweep_at_ = std::max<std::size_t>(64, 2 * pending_.size());
}

void ReplayAllocator::note_reserved() {
  stats_.peak_bytes = std::max(stats_.peak_bytes, stats_.live_bytes);
  stats_.peak_reserved_bytes =
      std::max(stats_.peak_reserved_bytes, stats_.arena_bytes + stats_.fallback_bytes);
}

void* ReplayAllocator::allocate(std::size_t size, Stream stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  void* pointer = nullptr;
  char* arena = nullptr;
  if (!window_) {
    ++stats_.outside;
  } else if (!plan_sizes_.empty()) {
    const std::size_t request = next_request_;
    std::size_t k = request;
    while (k < plan_sizes_.size() && plan_offsets_[k] == kUnplanned && plan_sizes_[k] != size) ++k;
    if (k >= plan_sizes_.size() || plan_sizes_[k] != size) {
      ++stats_.diverged;  // another size, or past the plan (Note [divergence] in replay_allocator.h)
      next_request_ = request + 1;
    } else {
      next_request_ = k + 1;
      const std::size_t offset = plan_offsets_[k];
      if (offset == kUnplanned) {
        ++stats_.unplanned;
      } else if (!range_free(offset, size)) {
        ++stats_.occupied;
      } else {
        if (!pending_.empty()) order_after_frees(offset, size, stream);
        pointer = arena_ + offset;
        arena = arena_;
        live_planned_[offset] = offset + size;
        ++stats_.served;
      }
    }
  }
  std::int64_t index = -1;
  if (window_) {
    index = static_cast<std::int64_t>(log_.size());
    log_.push_back(Event{size, ++clock_, -1});
  }
  if (arena == nullptr) {
    pointer = fallback_alloc_(size, stream);
    ++stats_.fallback;
    if (pointer == nullptr) {
      ++stats_.failed;
      return nullptr;
    }
    stats_.fallback_bytes += size;
  }
  live_[pointer] = Live{size, index, arena, stream};
  ++stats_.live;
  stats_.live_bytes += size;
  note_reserved();
  return pointer;
}

void ReplayAllocator::deallocate(void* pointer) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = live_.find(pointer);
  if (found == live_.end()) {
    throw std::invalid_argument("deallocate: address not handed out by this allocator");
  }
  const Live info = found->second;
  live_.erase(found);
  --stats_.live;
  stats_.live_bytes -= info.size;
  if (window_ && info.index >= 0) log_[static_cast<std::size_t>(info.index)].end = ++clock_;
  if (info.arena == nullptr) {
    stats_.fallback_bytes -= info.size;
    fallback_free_(pointer, info.size, info.stream);
  } else if (info.arena == arena_) {
    const auto offset = static_cast<std::size_t>(static_cast<char*>(pointer) - arena_);
    live_planned_.erase(offset);
    if (fences_.record) {
      void* fence = fences_.record(info.stream);
      if (fence != nullptr) pending_.push_back(Pending{offset, offset + info.size, info.stream, fence});
    }
  } else if (--retired_[info.arena].first == 0) {
    release_arena(info.arena);
  }
}

ReplayAllocator::Stats ReplayAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void ReplayAllocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.peak_bytes = stats_.live_bytes;
  stats_.peak_reserved_bytes = stats_.arena_bytes + stats_.fallback_bytes;
}

}  // namespace actoff
