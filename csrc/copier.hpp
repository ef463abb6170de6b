// The copy engine: moves byte spans from host memory (file mappings
// included) into device buffers on a CUDA stream, or into CPU buffers through
// the same pipeline when there is no GPU.
//
// staged: worker threads memcpy source bytes into a bounded ring of pinned
//   slots (page faults on the mapping happen there, off the caller's thread,
//   and a CPU read never breaks copy-on-write), then cudaMemcpyAsync slot ->
//   destination on the stream; an event per slot recycles it.
// direct: one cudaMemcpyAsync per span straight from the source (the seed's
//   path, kept for comparison; a GPU copying from a private writable mapping
//   can break copy-on-write).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cuda_api.hpp"

namespace mapoffload {

enum class CopyMode { staged, direct };

struct CopierConfig {
  int device = -1;  // CUDA ordinal, or -1 for CPU destinations
  CopyMode mode = CopyMode::staged;
  size_t threads = 4;
  size_t slot_bytes = 8u << 20;
  size_t slots = 8;
  size_t readahead_units = 0;  // 0: as many as threads
};

struct CopySpan {
  uint64_t dst, src, nbytes;
};

// A SIGBUS while reading a source mapping (its file was truncated).
class MappingFault : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Counters, cumulative over the copier's life.
struct CopyStats {
  uint64_t jobs = 0, units = 0, bytes = 0, faults = 0;
  uint64_t read_ns = 0;       // memcpy source -> slot (staged) or source -> destination (CPU direct)
  uint64_t submit_ns = 0;     // enqueueing H2D copies, or memcpy slot -> destination on CPU
  uint64_t slot_wait_ns = 0;  // waiting for a free slot and its event
};

// One copy() call: completes when every unit is enqueued (CUDA) or done (CPU).
class CopyJob {
 public:
  explicit CopyJob(size_t units) : remaining_(units) {}
  void wait();  // rethrows the first worker error
  bool done();
  bool failed() const { return failed_.load(std::memory_order_relaxed); }
  void finish_unit(std::exception_ptr err);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  size_t remaining_;
  std::exception_ptr error_;
  std::atomic<bool> failed_{false};
};

class Copier {
 public:
  explicit Copier(const CopierConfig& cfg);
  ~Copier();
  Copier(const Copier&) = delete;
  Copier& operator=(const Copier&) = delete;

  // Queues the spans; never blocks on the copy itself. stream: cudaStream_t
  // as an integer (ignored on CPU).
  std::shared_ptr<CopyJob> submit(const std::vector<CopySpan>& spans, uint64_t stream);
  // Readahead hint for what comes next.
  void advise(const std::vector<CopySpan>& spans) const;
  // Stops the workers. cancel=false waits for queued work; cancel=true fails
  // queued units ("copier closed") and waits only for those in flight.
  void close(bool cancel);
  bool closed() const { return closed_; }

  CopyStats stats() const;
  const CopierConfig& config() const { return cfg_; }

 private:
  struct Piece {
    uint64_t dst, src, nbytes, slot_off;
    uint64_t span_src, span_bytes;  // the whole source span, for error messages
  };
  // Source byte ranges of a unit (contiguous pieces merged), for readahead.
  using Ranges = std::vector<std::pair<uint64_t, uint64_t>>;
  struct Unit {
    std::shared_ptr<CopyJob> job;
    std::vector<Piece> pieces;
    std::shared_ptr<const Ranges> ranges;  // shared: workers read it outside the lock
    uint64_t stream = 0;
    uint64_t bytes = 0;
  };
  struct Slot {
    char* ptr = nullptr;
    cudaEvent_t event = nullptr;
    bool pending = false;  // an H2D copy from it may still run
  };

  void worker();
  void run_staged(Unit& u);
  void run_direct(Unit& u);
  size_t acquire_slot();
  void release_slot(size_t i);
  static std::shared_ptr<const Ranges> source_ranges(const std::vector<Piece>& pieces);
  static void advise_ranges(const Ranges& r);
  void free_slots();
  static void copy_in(const Piece& p, char* dst);

  CopierConfig cfg_;
  bool closed_ = false;
  std::vector<Slot> slots_;
  std::vector<size_t> free_;
  std::mutex slot_mu_;
  std::condition_variable slot_cv_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Unit> queue_;
  bool stop_ = false;
  std::vector<std::thread> threads_;

  std::atomic<uint64_t> jobs_{0}, units_{0}, bytes_{0}, faults_{0};
  std::atomic<uint64_t> read_ns_{0}, submit_ns_{0}, slot_wait_ns_{0};
};

}  // namespace mapoffload
