#include "copy_job.hpp"

#include <unistd.h>

namespace mapoffload {

namespace {
constexpr cudaError_t kCudaErrorNotReady = 600;
}

// --- Health ---------------------------------------------------------------------

void Health::set_broken(std::exception_ptr err) {
  int expected = 0;
  if (!state_.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) return;  // first error wins
  err_ = err;
  state_.store(2, std::memory_order_release);
}

std::string Health::what() const {
  if (!broken()) return "";
  try {
    std::rethrow_exception(err_);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

bool cuda_error_is_sticky() {
  try {
    const CudaApi& api = cuda_api();
    api.GetLastError();  // clears a non-sticky error
    return api.GetLastError() != kCudaSuccess;
  } catch (...) {
    return true;
  }
}

void note_cuda_failure(Health& health, std::exception_ptr err) {
  try {
    std::rethrow_exception(err);
  } catch (const CudaError&) {
    if (cuda_error_is_sticky()) health.set_broken(err);
  } catch (...) {
  }
}

// --- CopyJob --------------------------------------------------------------------

CopyJob::CopyJob(size_t units, int device, uint64_t stream, cudaEvent_t event, std::shared_ptr<Health> health)
    : sync_(new Sync), remaining_(units), device_(device), stream_(stream), event_(event), pid_(getpid()),
      health_(std::move(health)) {
  if (remaining_ == 0) {
    enqueued_ = true;
    finished_ = true;
  }
}

CopyJob::~CopyJob() {
  // In a forked child the CUDA runtime is unusable; the event leaks there.
  if (event_ && device_ok()) cuda_api().EventDestroy(event_);
}

bool CopyJob::device_ok() const { return device_ >= 0 && getpid() == pid_; }

void CopyJob::finish_unit(std::exception_ptr err) {
  bool last;
  {
    std::lock_guard<std::mutex> lock(sync_->mu);
    if (err && !error_) {
      error_ = err;
      failed_.store(true, std::memory_order_relaxed);
    }
    last = --remaining_ == 0;
  }
  if (!last) return;
  // Every unit has handed its copies to the stream (stream order: each
  // worker's cudaMemcpyAsync returned before it counted its unit down), so an
  // event recorded now follows all of them — failed jobs included, whose
  // earlier units may still be copying.
  bool recorded = false;
  std::exception_ptr record_err;
  if (event_ && device_ok() && !health_->broken()) {
    try {
      // Stream 0 is the legacy default stream of the *current* device: the
      // copier's, whichever thread records (a worker, or close() on the caller's).
      DeviceScope scope(device_);
      MAPOFFLOAD_CUDA_CHECK(cuda_api().EventRecord(event_, reinterpret_cast<cudaStream_t>(stream_)));
      recorded = true;
    } catch (...) {
      record_err = std::current_exception();
      note_cuda_failure(*health_, record_err);
    }
  }
  {
    std::lock_guard<std::mutex> lock(sync_->mu);
    if (record_err && !error_) {
      error_ = record_err;
      failed_.store(true, std::memory_order_relaxed);
    }
    recorded_ = recorded;
    enqueued_ = true;
    if (!recorded) finish_locked();
  }
  sync_->cv.notify_all();
}

void CopyJob::sync_device() {
  cudaEvent_t ev = nullptr;
  {
    std::lock_guard<std::mutex> lock(sync_->mu);
    if (finished_) return;
    ev = event_;
    ++users_;  // keeps the event alive while this thread waits on it unlocked
  }
  std::exception_ptr err;
  if (device_ >= 0 && getpid() != pid_) {
    err = std::make_exception_ptr(std::runtime_error(
        "the process forked while this copy was in flight: in the child it never completes (wait in the parent)"));
  } else if (device_ok() && ev) {
    try {
      MAPOFFLOAD_CUDA_CHECK(cuda_api().EventSynchronize(ev));
    } catch (...) {
      err = std::current_exception();
      note_cuda_failure(*health_, err);
    }
  }
  std::lock_guard<std::mutex> lock(sync_->mu);
  --users_;
  if (err && !error_) {
    error_ = err;
    failed_.store(true, std::memory_order_relaxed);
  }
  finish_locked();
}

void CopyJob::finish_locked() {
  // A finished job needs its event no more: give it back now (once no
  // thread is waiting on it) rather than when the last handle goes.
  finished_ = true;
  if (users_ == 0 && event_) {
    if (device_ok()) cuda_api().EventDestroy(event_);
    event_ = nullptr;
  }
}

void CopyJob::wait() {
  {
    std::unique_lock<std::mutex> lock(sync_->mu);
    sync_->cv.wait(lock, [&] { return enqueued_; });
    if (finished_) {
      if (error_) std::rethrow_exception(error_);
      return;
    }
  }
  sync_device();
  std::lock_guard<std::mutex> lock(sync_->mu);
  if (error_) std::rethrow_exception(error_);
}

void CopyJob::wait_quietly() noexcept {
  try {
    wait();
  } catch (...) {
  }
}

bool CopyJob::wait_enqueued_for(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(sync_->mu);
  return sync_->cv.wait_for(lock, timeout, [&] { return enqueued_; });
}

bool CopyJob::enqueued() {
  std::lock_guard<std::mutex> lock(sync_->mu);
  return enqueued_;
}

bool CopyJob::done() {
  {
    std::lock_guard<std::mutex> lock(sync_->mu);
    if (!enqueued_) return false;
    if (finished_) return true;
  }
  if (device_ok()) {
    cudaError_t st;
    {
      std::lock_guard<std::mutex> lock(sync_->mu);
      if (finished_) return true;
      st = cuda_api().EventQuery(event_);
    }
    if (st == kCudaErrorNotReady) {
      // Not an error, but the runtime stores it as this thread's last error
      // all the same: left there, torch's next launch check on this thread
      // (cudaGetLastError) raises "device not ready" from an unrelated
      // kernel. torch clears it after its own queries; so must we.
      cuda_api().GetLastError();
      return false;
    }
    if (st != kCudaSuccess) {
      // An asynchronous failure of the copies: the job is over, and wait()
      // reports it.
      std::exception_ptr err;
      try {
        check_cuda(st, "cudaEventQuery(job)", __FILE__, __LINE__);
      } catch (...) {
        err = std::current_exception();
      }
      note_cuda_failure(*health_, err);
      std::lock_guard<std::mutex> lock(sync_->mu);
      if (!error_) {
        error_ = err;
        failed_.store(true, std::memory_order_relaxed);
      }
      if (!finished_ && users_ == 0) finish_locked();
      return true;
    }
  }
  std::lock_guard<std::mutex> lock(sync_->mu);
  if (!finished_) finish_locked();
  return true;
}

void CopyJob::wait_stream(uint64_t stream) {
  std::unique_lock<std::mutex> lock(sync_->mu);
  sync_->cv.wait(lock, [&] { return enqueued_; });
  if (error_) std::rethrow_exception(error_);
  if (!recorded_ || finished_ || !event_ || !device_ok()) return;
  try {
    // Stream 0 names the legacy default stream of the current device: make
    // the job's device current, or the caller's thread (torch leaves device 0
    // current while a model runs on cuda:1) would make another device wait.
    DeviceScope scope(device_);
    // Under the lock: the event cannot be given back meanwhile (a quick call).
    MAPOFFLOAD_CUDA_CHECK(cuda_api().StreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), event_, 0));
  } catch (...) {
    lock.unlock();
    note_cuda_failure(*health_, std::current_exception());
    throw;
  }
}

void CopyJob::fail_in_child(std::exception_ptr err) noexcept {
  // The parent's threads do not exist here: the old mutex may be locked
  // (by the fork handler) and the condition variable may count waiters that
  // will never wake. Both are leaked and replaced.
  (void)sync_.release();
  sync_.reset(new Sync);
  if (!enqueued_ || !finished_) {
    if (!error_) error_ = err;
    failed_.store(true, std::memory_order_relaxed);
    remaining_ = 0;
    enqueued_ = true;
    finished_ = true;
    recorded_ = false;
  }
}

}  // namespace mapoffload
