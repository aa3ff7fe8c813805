// Implementation of the POSIX I/O engine; the contract is in io_engine.h.
#include "io_engine.h"

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fcntl.h>
#include <sstream>
#include <sys/stat.h>
#include <unistd.h>

namespace actoff {
namespace {

std::string describe(const char* op, const std::string& path, std::size_t nbytes,
                     std::uint64_t offset) {
  std::ostringstream out;
  out << op << " of " << nbytes << " bytes at offset " << offset << " of " << path;
  return out.str();
}

void finish(RequestState& state, std::size_t bytes, int code, std::string message,
            double seconds = 0.0) {
  {
    std::lock_guard<std::mutex> lock(state.mutex);
    state.seconds = seconds;
    state.bytes_done = bytes;
    state.error_code = code;
    state.error_message = std::move(message);
    state.done = true;
  }
  state.cv.notify_all();
}

}  // namespace

bool Future::done() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->done;
}

double Future::elapsed() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->seconds;
}

std::size_t Future::wait(double timeout_s) const {
  std::unique_lock<std::mutex> lock(state_->mutex);
  if (timeout_s < 0) {
    state_->cv.wait(lock, [this] { return state_->done; });
  } else if (!state_->cv.wait_for(lock, std::chrono::duration<double>(timeout_s),
                                  [this] { return state_->done; })) {
    throw IoError("I/O request not done after " + std::to_string(timeout_s) +
                      " s: an I/O worker hangs or died",
                  ETIMEDOUT);
  }
  if (!state_->error_message.empty()) throw IoError(state_->error_message, state_->error_code);
  return state_->bytes_done;
}

IoEngine::IoEngine(const std::string& path, std::size_t num_threads, bool allow_direct,
                   std::size_t alignment)
    : path_(path), alignment_(alignment == 0 ? 4096 : alignment) {
  if (num_threads == 0) throw IoError("IoEngine needs at least one thread", EINVAL);
  buffered_fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (buffered_fd_ < 0) {
    int code = errno;
    throw IoError("cannot open " + path + ": " + std::strerror(code), code);
  }
#ifdef O_DIRECT
  // Some file systems (tmpfs, some FUSE mounts) refuse O_DIRECT: buffered I/O serves all.
  if (allow_direct) direct_fd_ = ::open(path.c_str(), O_RDWR | O_DIRECT | O_CLOEXEC);
#else
  (void)allow_direct;
#endif
  workers_.reserve(num_threads);
  for (std::size_t i = 0; i < num_threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

IoEngine::~IoEngine() { close(); }

void IoEngine::close() {
  // A second caller waits until the first has joined the workers and closed the descriptors:
  // on return the engine is closed, whoever closed it.
  std::lock_guard<std::mutex> closing(close_mutex_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return;
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& worker : workers_) worker.join();
  if (direct_fd_ >= 0) ::close(direct_fd_);
  if (buffered_fd_ >= 0) ::close(buffered_fd_);
  direct_fd_ = buffered_fd_ = -1;
}

Future IoEngine::pwrite(const void* buffer, std::size_t nbytes, std::uint64_t offset) {
  // The engine never writes through `buffer`; the cast only lets reads share Request.
  return submit(true, const_cast<char*>(static_cast<const char*>(buffer)), nbytes, offset);
}

Future IoEngine::pread(void* buffer, std::size_t nbytes, std::uint64_t offset) {
  return submit(false, static_cast<char*>(buffer), nbytes, offset);
}

Future IoEngine::submit(bool is_write, char* buffer, std::size_t nbytes, std::uint64_t offset) {
  auto state = std::make_shared<RequestState>();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) {
      finish(*state, 0, 0, describe(is_write ? "pwrite" : "pread", path_, nbytes, offset) +
                               " failed: the I/O engine is closed");
      return Future(state);
    }
    queue_.push_back(Request{is_write, buffer, nbytes, offset, state});
  }
  cv_.notify_one();
  return Future(state);
}

void IoEngine::reserve(std::uint64_t nbytes) {
  if (nbytes <= file_size()) return;
  int code = ::posix_fallocate(buffered_fd_, 0, static_cast<off_t>(nbytes));
  if (code == EOPNOTSUPP || code == EINVAL) {
    // File systems without fallocate: extend the file instead (sparse, but sized).
    code = ::ftruncate(buffered_fd_, static_cast<off_t>(nbytes)) == 0 ? 0 : errno;
  }
  if (code != 0) {
    std::ostringstream out;
    out << "cannot reserve " << nbytes << " bytes for " << path_ << ": " << std::strerror(code);
    throw IoError(out.str(), code);
  }
}

std::uint64_t IoEngine::file_size() const {
  struct stat info;
  if (::fstat(buffered_fd_, &info) != 0) return 0;
  return static_cast<std::uint64_t>(info.st_size);
}

std::size_t IoEngine::pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return queue_.size() + running_;
}

bool IoEngine::is_aligned(const Request& request) const {
  auto address = reinterpret_cast<std::uintptr_t>(request.buffer);
  return address % alignment_ == 0 && request.nbytes % alignment_ == 0 &&
         request.offset % alignment_ == 0;
}

void IoEngine::worker_loop() {
  for (;;) {
    Request request;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      // Note [drain on close]: queued requests still run after close(), so no Future
      // handed out is left pending forever.
      if (queue_.empty()) return;
      request = std::move(queue_.front());
      queue_.pop_front();
      ++running_;
    }
    execute(request);
    std::lock_guard<std::mutex> lock(mutex_);
    --running_;
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
      std::ostringstream out;
      out << describe(op, path_, request.nbytes, request.offset)
          << (request.is_write ? " made no progress" : " is a short read") << ": " << done
          << " of " << request.nbytes << " bytes moved (file size " << file_size() << ")";
      finish(*request.state, done, request.is_write ? ENOSPC : EIO, out.str(), seconds());
      return;
    }
    done += static_cast<std::size_t>(moved);
  }
  finish(*request.state, done, 0, std::string(), seconds());
}

}  // namespace actoff
