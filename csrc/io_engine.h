// actoff POSIX I/O engine: a thread pool doing pread/pwrite on one open file.
//
// Contract
// - What: asynchronous, positioned reads and writes of caller-owned host buffers to one
//   file, given as a descriptor (the engine works on its own duplicates, so the file may
//   have no name: actoff unlinks its spill files at once). Each call returns a Future; the
//   caller keeps the buffer alive and untouched until that Future is done. Requests whose
//   buffer address, size and file offset are all multiples of `alignment` go through an
//   O_DIRECT descriptor (reopened through /proc/self/fd, when the file system accepts
//   O_DIRECT); all others use ordinary buffered I/O.
// - Seals: a write given a Seal computes, in its worker, the CRC32C of what it wrote seeded
//   with the seal's sequence number and the length (crc32c.h: seal_start); Future::checksum
//   returns it. A read given a Seal computes the same over what it read and fails unless it
//   equals the seal's checksum. So a file changed, truncated and re-extended, or holding
//   another record's bytes fails the read, never the gradients; the training thread pays none
//   of it.
// - Thread-safety: every public method may be called from any thread. Requests are served
//   by `num_threads` workers in no particular order; two requests on overlapping ranges are
//   not ordered with respect to each other (the caller orders them by waiting).
// - Errors: a failed request never throws from the worker; its Future holds the error and
//   `wait()` throws IoError with the operation, path, offset, size and errno text: EIO for a
//   short read (the end of the file came early: never a silent partial buffer), EBADMSG for
//   a read whose bytes fail their seal. The constructor and reserve() throw IoError directly.
// - Shutdown: the destructor (or close()) finishes every queued request, joins the
//   workers and closes the engine's descriptors.
// - fork(): Note [engines across fork]. In a child, an engine of the parent refuses every
//   request, and close() and the destructor take no lock, join and signal nothing: what the
//   parent's threads own is leaked.
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

// An I/O failure: `code` is the errno value (0 for a closed engine).
class IoError : public std::runtime_error {
 public:
  IoError(const std::string& message, int code) : std::runtime_error(message), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};

// A record's seal: checked when `on`. A write fills in the checksum; a read checks it.
struct Seal {
  bool on = false;
  std::uint64_t sequence = 0;
  std::uint32_t checksum = 0;
};

// Shared between a request in flight and the Future handed to the caller.
struct RequestState {
  RequestState();
  ~RequestState();
  std::mutex mutex;
  // Heap-allocated so that a forked child can leak it: destroying a condition variable that
  // a parent's thread waited on blocks for ever (Note [engines across fork]).
  std::condition_variable* cv;
  std::uint64_t generation;  // the fork generation the request was made in
  bool done = false;
  int error_code = 0;
  std::string error_message;  // empty when the request succeeded
  std::size_t bytes_done = 0;
  double seconds = 0.0;  // time a worker spent on the request (not time in the queue)
  Seal seal;             // a sealed write's checksum, once done
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
  // The seal of what a sealed write wrote (on == false until it is done, or if unsealed).
  Seal seal() const;

 private:
  std::shared_ptr<RequestState> state_;
};

class IoEngine {
 public:
  // Serves the open file `fd` (read-write) through duplicates of it; `label` names it in
  // messages. The caller keeps `fd` or closes it, as it likes.
  IoEngine(int fd, const std::string& label, std::size_t num_threads, bool allow_direct,
           std::size_t alignment);
  ~IoEngine();
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  Future pwrite(const void* buffer, std::size_t nbytes, std::uint64_t offset, Seal seal = {});
  Future pread(void* buffer, std::size_t nbytes, std::uint64_t offset, Seal seal = {});

  // Grows the file to at least `nbytes` with real blocks (posix_fallocate), so that later
  // writes inside it cannot fail for lack of space. Throws IoError (ENOSPC, EFBIG, ...).
  void reserve(std::uint64_t nbytes);
  std::uint64_t file_size() const;
  bool direct_enabled() const { return direct_fd_ >= 0; }
  std::size_t alignment() const { return alignment_; }
  std::size_t num_threads() const { return num_threads_; }
  std::size_t pending() const;  // requests queued or running
  const std::string& path() const { return path_; }
  void close();

 private:
  struct Request {
    bool is_write;
    char* buffer;
    std::size_t nbytes;
    std::uint64_t offset;
    Seal seal;
    std::shared_ptr<RequestState> state;
  };
  // What the workers share with the callers; leaked, never destroyed, in a forked child.
  struct Shared {
    mutable std::mutex mutex;
    std::condition_variable cv;
    std::deque<Request> queue;
    std::size_t running = 0;
    bool stopping = false;
    std::mutex close_mutex;  // held for the whole of close()
  };

  Future submit(bool is_write, char* buffer, std::size_t nbytes, std::uint64_t offset, Seal seal);
  void worker_loop();
  void execute(const Request& request);
  bool is_aligned(const Request& request) const;
  bool forked() const;  // this process is a child forked after the engine was made
  void abandon();       // the child's close(): Note [engines across fork]

  std::string path_;
  std::size_t alignment_;
  std::size_t num_threads_;
  std::uint64_t generation_;
  int buffered_fd_ = -1;
  int direct_fd_ = -1;
  std::unique_ptr<Shared> shared_;
  std::vector<std::thread> workers_;
};

}  // namespace actoff
