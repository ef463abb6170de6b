// One copy() call, and the copier's health, shared with its jobs.
//
// Completion has one meaning: a job is *finished* when every byte is at its
// destination — on the CPU when the last memcpy returned, on CUDA when the
// device copies completed (an event recorded on the stream after the job's
// last copy). `enqueued` is the weaker state the host reaches first on CUDA:
// every copy has been handed to the stream. Stream-ordered waiting
// (wait_stream) needs only that.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

#include "cuda_api.hpp"

namespace mapoffload {

// A SIGBUS while reading a source mapping (its file was truncated).
class MappingFault : public std::runtime_error {
 public:
  MappingFault(const std::string& what, std::string path) : std::runtime_error(what), path_(std::move(path)) {}
  const std::string& path() const { return path_; }

 private:
  std::string path_;  // the mapped file, "" when unknown
};

// The MappingFault for a SIGBUS at `fault` while reading [span_src,
// span_src+span_bytes): names the mapped file and the byte range in it, from a
// fresh maps snapshot (copier.cpp).
MappingFault mapping_fault(uint64_t span_src, uint64_t span_bytes, uint64_t fault);

// A sticky error breaks the copier for good: written once, read lock-free
// (no mutex, so a fork can never find it locked).
class Health {
 public:
  void set_broken(std::exception_ptr err);
  bool broken() const { return state_.load(std::memory_order_acquire) == 2; }
  std::exception_ptr error() const { return broken() ? err_ : nullptr; }
  void rethrow_if_broken() const {
    if (broken()) std::rethrow_exception(err_);
  }
  std::string what() const;

 private:
  std::atomic<int> state_{0};  // 0 healthy, 1 being written, 2 broken
  std::exception_ptr err_;
};

// After a failed CUDA call: true when the error is sticky (the context is
// unusable: every later call fails too). Clears a non-sticky error.
bool cuda_error_is_sticky();

// Records `err` in `health` when it is a sticky CUDA error.
void note_cuda_failure(Health& health, std::exception_ptr err);

class CopyJob {
 public:
  // device < 0: CPU destinations. event: recorded on `stream` after the last
  // unit (owned; may be null on CPU).
  CopyJob(size_t units, int device, uint64_t stream, cudaEvent_t event, std::shared_ptr<Health> health);
  ~CopyJob();
  CopyJob(const CopyJob&) = delete;
  CopyJob& operator=(const CopyJob&) = delete;

  // Blocks until finished; rethrows the first error.
  void wait();
  // Finished (non-blocking; never throws).
  bool done();
  // Every copy is on the stream (or done, on CPU), or the job failed.
  bool enqueued();
  // Waits up to `timeout` for enqueued(); true when it is (callers poll, to
  // stay interruptible).
  bool wait_enqueued_for(std::chrono::milliseconds timeout);
  // Blocks until enqueued, rethrows the job's error, then makes `stream` wait
  // on the device for the job's copies (cudaStreamWaitEvent; stream 0 is the
  // legacy default stream of the job's device). CPU: no-op.
  void wait_stream(uint64_t stream);
  // Blocks until finished and swallows errors (shutdown paths).
  void wait_quietly() noexcept;

  bool failed() const { return failed_.load(std::memory_order_relaxed); }
  // The CUDA ordinal the job copies to, or -1 for CPU destinations.
  int device() const { return device_; }
  // Worker side: one unit processed (err: its failure). The last one records
  // the completion event.
  void finish_unit(std::exception_ptr err);

  // Fork support (copier.cpp): lock / unlock the job's mutex around fork(),
  // and in the child replace it and fail the job.
  std::mutex& fork_mutex() { return sync_->mu; }
  void fail_in_child(std::exception_ptr err) noexcept;

 private:
  struct Sync {
    std::mutex mu;
    std::condition_variable cv;
  };
  // Device-side completion of an enqueued job (no lock held).
  void sync_device();
  // finished_ = true and the event given back (lock held).
  void finish_locked();
  bool device_ok() const;

  std::unique_ptr<Sync> sync_;
  size_t remaining_;
  bool enqueued_ = false;
  bool finished_ = false;
  bool recorded_ = false;  // event_ was recorded after the last copy
  int users_ = 0;          // threads waiting on event_ without the lock
  std::exception_ptr error_;
  std::atomic<bool> failed_{false};
  const int device_;
  const uint64_t stream_;
  cudaEvent_t event_;
  const pid_t pid_;
  std::shared_ptr<Health> health_;
};

}  // namespace mapoffload
