// Implementation of the plan-replaying allocator core; the contract is in replay_allocator.h.
#include "replay_allocator.h"

#include <stdexcept>
#include <string>

namespace actoff {

ReplayAllocator::ReplayAllocator(AllocFn fallback_alloc, FreeFn fallback_free)
    : fallback_alloc_(std::move(fallback_alloc)), fallback_free_(std::move(fallback_free)) {}

ReplayAllocator::~ReplayAllocator() {
  // Return what the fallback still holds; arena memory belongs to the caller.
  for (auto& [pointer, info] : live_) {
    if (!std::get<2>(info)) fallback_free_(pointer, std::get<0>(info));
  }
}

void ReplayAllocator::begin_record() {
  std::lock_guard<std::mutex> lock(mutex_);
  recording_ = true;
  clock_ = 0;
  log_.clear();
}

std::vector<ReplayAllocator::Event> ReplayAllocator::end_record() {
  std::lock_guard<std::mutex> lock(mutex_);
  recording_ = false;
  for (auto& [pointer, info] : live_) std::get<1>(info) = -1;  // no longer points into the log
  return std::move(log_);
}

void ReplayAllocator::set_plan(const std::vector<std::size_t>& sizes,
                               const std::vector<std::size_t>& offsets, void* arena,
                               std::size_t arena_bytes) {
  if (sizes.size() != offsets.size()) {
    throw std::invalid_argument("set_plan: " + std::to_string(sizes.size()) + " sizes but " +
                                std::to_string(offsets.size()) + " offsets");
  }
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    if (offsets[k] + sizes[k] > arena_bytes) {
      throw std::invalid_argument("set_plan: request " + std::to_string(k) + " ends at " +
                                  std::to_string(offsets[k] + sizes[k]) + ", past the arena of " +
                                  std::to_string(arena_bytes) + " bytes");
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  plan_sizes_ = sizes;
  plan_offsets_ = offsets;
  arena_ = static_cast<char*>(arena);
  arena_bytes_ = arena_bytes;
  next_request_ = 0;
}

void ReplayAllocator::clear_plan() {
  std::lock_guard<std::mutex> lock(mutex_);
  plan_sizes_.clear();
  plan_offsets_.clear();
  next_request_ = 0;
}

void ReplayAllocator::begin_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  next_request_ = 0;
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

void* ReplayAllocator::allocate(std::size_t size) {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::size_t request = next_request_++;
  void* pointer = nullptr;
  bool from_arena = false;
  if (!plan_sizes_.empty()) {
    if (request < plan_sizes_.size() && plan_sizes_[request] == size &&
        range_free(plan_offsets_[request], size)) {
      pointer = arena_ + plan_offsets_[request];
      live_planned_[plan_offsets_[request]] = plan_offsets_[request] + size;
      from_arena = true;
      ++stats_.served;
    } else {
      ++stats_.diverged;  // Note [divergence]: another size, past the plan, or still occupied
    }
  }
  if (!from_arena) {
    pointer = fallback_alloc_(size);
    ++stats_.fallback;
  }
  std::int64_t index = -1;
  if (recording_) {
    index = static_cast<std::int64_t>(log_.size());
    log_.push_back(Event{size, ++clock_, -1});
  }
  live_[pointer] = std::make_tuple(size, index, from_arena);
  ++stats_.live;
  return pointer;
}

void ReplayAllocator::deallocate(void* pointer) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = live_.find(pointer);
  if (found == live_.end()) {
    throw std::invalid_argument("deallocate: address not handed out by this allocator");
  }
  auto [size, index, from_arena] = found->second;
  live_.erase(found);
  --stats_.live;
  if (recording_ && index >= 0) log_[static_cast<std::size_t>(index)].end = ++clock_;
  if (from_arena) {
    live_planned_.erase(static_cast<std::size_t>(static_cast<char*>(pointer) - arena_));
  } else {
    fallback_free_(pointer, size);
  }
}

ReplayAllocator::Stats ReplayAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

}  // namespace actoff
