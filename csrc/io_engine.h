// actoff POSIX I/O engine: a thread pool doing pread/pwrite on one file.
//
// Contract
// - What: asynchronous, positioned reads and writes of caller-owned host buffers to one
//   file. Each call returns a Future; the caller keeps the buffer alive and untouched
//   until that Future is done. Requests whose buffer address, size and file offset are
//   all multiples of `alignment` go through an O_DIRECT descriptor (when the file system
//   accepts O_DIRECT); all others use ordinary buffered I/O on a second descriptor.
// - Thread-safety: every public method may be called from any thread. Requests are served
//   by `num_threads` workers in no particular order; two requests on overlapping ranges are
//   not ordered with respect to each other (the caller orders them by waiting).
// - Errors (a short read carries EIO): a failed request never throws from the worker; its Future holds the error and
//   `wait()` throws IoError with the operation, path, offset, size and errno text. A read
//   that reaches the end of the file early is an error ("short read"), never a silent
//   partial buffer. The constructor and reserve() throw IoError directly.
// - Shutdown: the destructor (or close()) finishes every queued request, joins the
//   workers and closes the descriptors. It never removes the file.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace actoff {

// An I/O failure: `code` is the errno value (0 for a short read or a closed engine).
class IoError : public std::runtime_error {
 public:
  IoError(const std::string& message, int code) : std::runtime_error(message), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};

// Shared between a request in flight and the Future handed to the caller.
struct RequestState {
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  int error_code = 0;
  std::string error_message;  // empty when the request succeeded
  std::size_t bytes_done = 0;
  double seconds = 0.0;  // time a worker spent on the request (not time in the queue)
};

// The caller's view of one request. Copyable; all copies observe the same request.
class Future {
 public:
  explicit Future(std::shared_ptr<RequestState> state) : state_(std::move(state)) {}
  // True once the request finished, successfully or not. Never blocks.
  bool done() const;
  // Blocks until the request finished; throws IoError if it failed. Returns the bytes moved.
  // With timeout_s >= 0, throws IoError(ETIMEDOUT) if the request is not done by then (a
  // worker that hangs or died); the request itself is not cancelled.
  std::size_t wait(double timeout_s = -1.0) const;
  // Seconds a worker spent serving the request (0 until done).
  double elapsed() const;

 private:
  std::shared_ptr<RequestState> state_;
};

class IoEngine {
 public:
  // Opens (creating with mode 0600 if needed) `path` for reading and writing.
  IoEngine(const std::string& path, std::size_t num_threads, bool allow_direct,
           std::size_t alignment);
  ~IoEngine();
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  Future pwrite(const void* buffer, std::size_t nbytes, std::uint64_t offset);
  Future pread(void* buffer, std::size_t nbytes, std::uint64_t offset);

  // Grows the file to at least `nbytes` with real blocks (posix_fallocate), so that later
  // writes inside it cannot fail for lack of space. Throws IoError (ENOSPC, EFBIG, ...).
  void reserve(std::uint64_t nbytes);
  std::uint64_t file_size() const;
  bool direct_enabled() const { return direct_fd_ >= 0; }
  std::size_t alignment() const { return alignment_; }
  std::size_t num_threads() const { return workers_.size(); }
  std::size_t pending() const;  // requests queued or running
  const std::string& path() const { return path_; }
  void close();

 private:
  struct Request {
    bool is_write;
    char* buffer;
    std::size_t nbytes;
    std::uint64_t offset;
    std::shared_ptr<RequestState> state;
  };

  Future submit(bool is_write, char* buffer, std::size_t nbytes, std::uint64_t offset);
  void worker_loop();
  void execute(const Request& request);
  bool is_aligned(const Request& request) const;

  std::string path_;
  std::size_t alignment_;
  int buffered_fd_ = -1;
  int direct_fd_ = -1;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Request> queue_;
  std::size_t running_ = 0;
  bool stopping_ = false;
  std::mutex close_mutex_;  // held for the whole of close()
  std::vector<std::thread> workers_;
};

}  // namespace actoff
