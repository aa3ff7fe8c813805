// Implementation of the POSIX I/O engine; the contract is in io_engine.h.
#include "io_engine.h"

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <pthread.h>
#include <string>
#include <sys/stat.h>
#include <unistd.h>

#include "crc32c.h"

namespace actoff {
namespace {

// Note [engines across fork]: fork() copies only the calling thread. In a child, an engine
// made before the fork has no workers, and its mutexes and condition variables hold whatever
// state the parent's threads left in them: locked by a thread that does not exist, waited on
// by workers that do not exist. Joining those workers, broadcasting to them (glibc blocks in
// pthread_cond_broadcast) or destroying such a condition variable (pthread_cond_destroy waits
// for its waiters) hangs the child for ever, as in a child that left through sys.exit and
// ran actoff's exit handlers. So every fork bumps a generation (pthread_atfork; no lock), and
// an engine, or a request, of an earlier generation is the parent's: the child refuses its
// requests, reads nothing it guards under a lock, and leaks its threads, queue and condition
// variables instead of joining or destroying them. The parent's file is left alone too.
std::atomic<std::uint64_t> fork_generation{0};

void count_fork() { fork_generation.fetch_add(1, std::memory_order_relaxed); }

std::uint64_t current_generation() {
  static const int registered = ::pthread_atfork(nullptr, nullptr, count_fork);
  (void)registered;
  return fork_generation.load(std::memory_order_relaxed);
}

// Messages are built from strings and std::to_string, never from iostreams: an ostream formats
// numbers through the process's global locale, whose facets another library's C++ runtime may
// have made (a worker thread crashed there inside a CUDA process, formatting a short read's
// message: benchmarks/results/h200-2026-11-28-call3/).
std::string describe(const char* op, const std::string& path, std::size_t nbytes,
                     std::uint64_t offset) {
  return std::string(op) + " of " + std::to_string(nbytes) + " bytes at offset " +
         std::to_string(offset) + " of " + path;
}

std::string hex(std::uint32_t value) {
  char text[16];
  std::snprintf(text, sizeof(text), "%#010x", value);
  return text;
}

void finish(RequestState& state, std::size_t bytes, int code, std::string message,
            double seconds = 0.0, Seal seal = {}) {
  {
    std::lock_guard<std::mutex> lock(state.mutex);
    state.seconds = seconds;
    state.bytes_done = bytes;
    state.error_code = code;
    state.error_message = std::move(message);
    state.seal = seal;
    state.done = true;
  }
  state.cv->notify_all();
}

}  // namespace

RequestState::RequestState() : cv(new std::condition_variable), generation(current_generation()) {}

RequestState::~RequestState() {
  if (generation == current_generation()) delete cv;  // else leaked: Note [engines across fork]
}

bool Future::done() const {
  if (state_->generation != current_generation()) return state_->done;  // no lock in a child
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->done;
}

double Future::elapsed() const {
  if (state_->generation != current_generation()) return 0.0;
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->seconds;
}

Seal Future::seal() const {
  if (state_->generation != current_generation()) return Seal{};
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->done ? state_->seal : Seal{};
}

std::size_t Future::wait(double timeout_s) const {
  if (state_->generation != current_generation()) {
    // The parent's request: its worker is not in this process (Note [engines across fork]).
    if (!state_->done)
      throw IoError("an I/O request of the parent process cannot be waited for in a forked child",
                    ECHILD);
    if (!state_->error_message.empty()) throw IoError(state_->error_message, state_->error_code);
    return state_->bytes_done;
  }
  std::unique_lock<std::mutex> lock(state_->mutex);
  if (timeout_s < 0) {
    state_->cv->wait(lock, [this] { return state_->done; });
  } else if (!state_->cv->wait_for(lock, std::chrono::duration<double>(timeout_s),
                                   [this] { return state_->done; })) {
    throw IoError("I/O request not done after " + std::to_string(timeout_s) +
                      " s: an I/O worker hangs or died",
                  ETIMEDOUT);
  }
  if (!state_->error_message.empty()) throw IoError(state_->error_message, state_->error_code);
  return state_->bytes_done;
}

IoEngine::IoEngine(int fd, const std::string& label, std::size_t num_threads, bool allow_direct,
                   std::size_t alignment)
    : path_(label),
      alignment_(alignment == 0 ? 4096 : alignment),
      num_threads_(num_threads),
      generation_(current_generation()),
      shared_(new Shared) {
  if (num_threads == 0) throw IoError("IoEngine needs at least one thread", EINVAL);
  buffered_fd_ = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (buffered_fd_ < 0) {
    int code = errno;
    throw IoError("cannot use the descriptor of " + label + ": " + std::strerror(code), code);
  }
#ifdef O_DIRECT
  // A second open file description with O_DIRECT (a dup would share the status flags). Some
  // file systems (tmpfs, some FUSE mounts) refuse O_DIRECT: buffered I/O serves all then.
  if (allow_direct) {
    const std::string self = "/proc/self/fd/" + std::to_string(buffered_fd_);
    direct_fd_ = ::open(self.c_str(), O_RDWR | O_DIRECT | O_CLOEXEC);
  }
#else
  (void)allow_direct;
#endif
  workers_.reserve(num_threads);
  for (std::size_t i = 0; i < num_threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

IoEngine::~IoEngine() { close(); }

bool IoEngine::forked() const { return generation_ != current_generation(); }

void IoEngine::abandon() {
  if (!shared_) return;
  // Leak, never join or destroy, what the parent's threads own (Note [engines across fork]).
  (void)shared_.release();
  (void)new std::vector<std::thread>(std::move(workers_));  // never destroyed: no terminate()
  if (direct_fd_ >= 0) ::close(direct_fd_);  // this process's copies of the descriptors only
  if (buffered_fd_ >= 0) ::close(buffered_fd_);
  direct_fd_ = buffered_fd_ = -1;
}

void IoEngine::close() {
  if (forked()) return abandon();
  // A second caller waits until the first has joined the workers and closed the descriptors:
  // on return the engine is closed, whoever closed it.
  std::lock_guard<std::mutex> closing(shared_->close_mutex);
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    if (shared_->stopping) return;
    shared_->stopping = true;
  }
  shared_->cv.notify_all();
  for (auto& worker : workers_) worker.join();
  if (direct_fd_ >= 0) ::close(direct_fd_);
  if (buffered_fd_ >= 0) ::close(buffered_fd_);
  direct_fd_ = buffered_fd_ = -1;
}

Future IoEngine::pwrite(const void* buffer, std::size_t nbytes, std::uint64_t offset, Seal seal) {
  // The engine never writes through `buffer`; the cast only lets reads share Request.
  return submit(true, const_cast<char*>(static_cast<const char*>(buffer)), nbytes, offset, seal);
}

Future IoEngine::pread(void* buffer, std::size_t nbytes, std::uint64_t offset, Seal seal) {
  return submit(false, static_cast<char*>(buffer), nbytes, offset, seal);
}

Future IoEngine::submit(bool is_write, char* buffer, std::size_t nbytes, std::uint64_t offset,
                        Seal seal) {
  auto state = std::make_shared<RequestState>();
  const char* op = is_write ? "pwrite" : "pread";
  if (forked()) {
    finish(*state, 0, ECHILD, describe(op, path_, nbytes, offset) +
                                  " failed: the I/O engine belongs to the parent process "
                                  "(this process was forked from it)");
    return Future(state);
  }
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    if (shared_->stopping) {
      finish(*state, 0, 0, describe(op, path_, nbytes, offset) + " failed: the I/O engine is closed");
      return Future(state);
    }
    shared_->queue.push_back(Request{is_write, buffer, nbytes, offset, seal, state});
  }
  shared_->cv.notify_one();
  return Future(state);
}

void IoEngine::reserve(std::uint64_t nbytes) {
  if (forked()) {
    throw IoError("cannot reserve space in " + path_ + ": its engine belongs to the parent process",
                  ECHILD);
  }
  if (nbytes <= file_size()) return;
  int code = ::posix_fallocate(buffered_fd_, 0, static_cast<off_t>(nbytes));
  if (code == EOPNOTSUPP || code == EINVAL) {
    // File systems without fallocate: extend the file instead (sparse, but sized).
    code = ::ftruncate(buffered_fd_, static_cast<off_t>(nbytes)) == 0 ? 0 : errno;
  }
  if (code != 0) {
    throw IoError("cannot reserve " + std::to_string(nbytes) + " bytes for " + path_ + ": " +
                      std::strerror(code),
                  code);
  }
}

std::uint64_t IoEngine::file_size() const {
  struct stat info;
  if (buffered_fd_ < 0 || ::fstat(buffered_fd_, &info) != 0) return 0;
  return static_cast<std::uint64_t>(info.st_size);
}

std::size_t IoEngine::pending() const {
  if (forked()) return 0;
  std::lock_guard<std::mutex> lock(shared_->mutex);
  return shared_->queue.size() + shared_->running;
}

bool IoEngine::is_aligned(const Request& request) const {
  auto address = reinterpret_cast<std::uintptr_t>(request.buffer);
  return address % alignment_ == 0 && request.nbytes % alignment_ == 0 &&
         request.offset % alignment_ == 0;
}

void IoEngine::worker_loop() {
  Shared& shared = *shared_;
  for (;;) {
    Request request;
    {
      std::unique_lock<std::mutex> lock(shared.mutex);
      shared.cv.wait(lock, [&shared] { return shared.stopping || !shared.queue.empty(); });
      // Note [drain on close]: queued requests still run after close(), so no Future
      // handed out is left pending forever.
      if (shared.queue.empty()) return;
      request = std::move(shared.queue.front());
      shared.queue.pop_front();
      ++shared.running;
    }
    execute(request);
    std::lock_guard<std::mutex> lock(shared.mutex);
    --shared.running;
  }
}

void IoEngine::execute(const Request& request) {
  const int fd = (direct_fd_ >= 0 && is_aligned(request)) ? direct_fd_ : buffered_fd_;
  const char* op = request.is_write ? "pwrite" : "pread";
  const auto started = std::chrono::steady_clock::now();
  auto seconds = [&started] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  };
  std::size_t done = 0;
  while (done < request.nbytes) {
    const std::size_t left = request.nbytes - done;
    const off_t at = static_cast<off_t>(request.offset + done);
    ssize_t moved = request.is_write ? ::pwrite(fd, request.buffer + done, left, at)
                                     : ::pread(fd, request.buffer + done, left, at);
    if (moved < 0) {
      if (errno == EINTR) continue;
      const int code = errno;
      finish(*request.state, done, code,
             describe(op, path_, request.nbytes, request.offset) + " failed: " +
                 std::strerror(code) + " (errno " + std::to_string(code) + ")",
             seconds());
      return;
    }
    if (moved == 0) {
      finish(*request.state, done, request.is_write ? ENOSPC : EIO,
             describe(op, path_, request.nbytes, request.offset) +
                 (request.is_write ? " made no progress" : " is a short read") + ": " +
                 std::to_string(done) + " of " + std::to_string(request.nbytes) +
                 " bytes moved (file size " + std::to_string(file_size()) + ")",
             seconds());
      return;
    }
    done += static_cast<std::size_t>(moved);
  }
  Seal seal = request.seal;
  if (seal.on) {  // in this worker, where the bytes already are: the caller's thread pays nothing
    const std::uint32_t checksum =
        crc32c(seal_start(seal.sequence, request.nbytes), request.buffer, request.nbytes);
    if (request.is_write) {
      seal.checksum = checksum;
    } else if (checksum != seal.checksum) {
      finish(*request.state, done, EBADMSG,
             describe(op, path_, request.nbytes, request.offset) +
                 " read bytes that are not the ones written there: checksum " + hex(checksum) +
                 ", write " + std::to_string(seal.sequence) + " sealed " + hex(seal.checksum) +
                 " (the file was changed, truncated or replaced after it was written)",
             seconds());
      return;
    }
  }
  finish(*request.state, done, 0, std::string(), seconds(), seal);
}

}  // namespace actoff
