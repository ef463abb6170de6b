// The copy engine: moves byte spans from host memory (file mappings
// included) into device buffers on a CUDA stream, or into CPU buffers through
// the same pipeline when there is no GPU.
//
// staged: worker threads memcpy source bytes into a bounded ring of pinned
//   slots (page faults on the mapping happen there, off the caller's thread,
//   and a CPU read never breaks copy-on-write), then cudaMemcpyAsync slot ->
//   destination on the stream; an event per slot recycles it.
// direct: one cudaMemcpyAsync per span straight from the source. The mode
//   for pinned sources (DMA needs no staging), chosen per span; as the whole
//   copier's mode it is the seed's path, kept for comparison (a GPU copying
//   from a private writable mapping can break copy-on-write).
//
// Ownership: the engine holds raw addresses; whoever submits keeps sources
// and destinations alive until the job is finished (the Python binding holds
// the caller's objects until then, so dropping a handle early is safe).
//
// Failure: every error path gives back the slot it took. A sticky CUDA error
// breaks the copier: the job that met it and every later one fail at once
// with that CudaError; close() always returns. fork(): the child's copier
// fails the jobs that were in flight; a CPU copier restarts its workers on
// the next copy, a CUDA copier refuses (CUDA does not survive fork).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "copy_job.hpp"
#include "cuda_api.hpp"

namespace mapoffload {

enum class CopyMode { staged, direct };

struct CopierConfig {
  int device = -1;  // CUDA ordinal, or -1 for CPU destinations
  CopyMode mode = CopyMode::staged;
  // No defaults here: the Python face (mapoffload.copier.resolve_settings) is
  // their one place, and always gives all three (0 is refused).
  size_t threads = 0;
  size_t slot_bytes = 0;
  size_t slots = 0;
  size_t readahead_units = 0;  // 0: as many as threads
};

// Limits that keep a typo from exhausting the machine.
constexpr size_t kMaxThreads = 256;
constexpr size_t kMaxSlots = 4096;
constexpr uint64_t kMaxSlotBytes = uint64_t{1} << 32;
constexpr uint64_t kMinSlotBytes = 4096;  // one page: the smallest slot (sizes are rounded up to pages)

struct CopySpan {
  uint64_t dst, src, nbytes;
  bool direct = false;  // DMA straight from src (a pinned source): no staging
};

// Counters, cumulative over the copier's life.
struct CopyStats {
  uint64_t jobs = 0, units = 0, bytes = 0, faults = 0;
  uint64_t read_ns = 0;       // memcpy source -> slot (staged) or source -> destination (CPU direct)
  uint64_t submit_ns = 0;     // enqueueing H2D copies, or memcpy slot -> destination on CPU
  uint64_t slot_wait_ns = 0;  // waiting for a free slot and its event
  uint64_t unstaged_bytes = 0;  // bytes copied without staging
};

// Throws std::invalid_argument naming the first pair at fault: a null
// address, an address range that wraps, a destination overlapping another
// destination or any source.
void validate_spans(const std::vector<CopySpan>& spans);

class Copier {
 public:
  explicit Copier(const CopierConfig& cfg);
  ~Copier();
  Copier(const Copier&) = delete;
  Copier& operator=(const Copier&) = delete;

  // Queues the spans (validated first); never blocks on the copy itself.
  // stream: cudaStream_t as an integer (ignored on CPU). wait_for: a stream
  // whose work already queued must finish before these copies start (none
  // when empty), e.g. the compute stream that last used a recycled
  // destination. 0 is a stream like any other there: the legacy default
  // stream, torch's default compute stream, which does not order torch's
  // side streams (they are non-blocking).
  std::shared_ptr<CopyJob> submit(const std::vector<CopySpan>& spans, uint64_t stream,
                                  std::optional<uint64_t> wait_for = std::nullopt);
  // Readahead hint for what comes next.
  void advise(const std::vector<CopySpan>& spans) const;
  // Stops the workers and frees the ring; always returns. cancel=false lets
  // queued work run first; cancel=true fails queued units ("copier closed")
  // and waits only for those in flight. Pending device copies out of the
  // slots are waited for.
  void close(bool cancel);
  bool closed() const;
  // The sticky error that broke the copier, or "".
  std::string broken() const { return health_->what(); }

  CopyStats stats() const;
  const CopierConfig& config() const { return cfg_; }

  // fork() handlers (registered once, process-wide).
  void fork_prepare();
  void fork_parent();
  void fork_child();

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
    bool direct = false;
  };
  struct Slot {
    char* ptr = nullptr;
    cudaEvent_t event = nullptr;
    bool pending = false;  // an H2D copy from it may still run
  };
  // Everything a thread can hold locked: replaced (the old one leaked) in a
  // forked child, where the threads that held it do not exist.
  struct Sync {
    std::mutex close_mu;  // serialises close()
    std::mutex mu;        // queue_, stop_, closed_, live_, threads_
    std::condition_variable cv;
    std::mutex slot_mu;   // free_
    std::condition_variable slot_cv;
  };

  std::vector<Unit> make_units(const std::vector<CopySpan>& spans, uint64_t stream) const;
  void start_workers();
  void stop_workers();
  void worker();
  void run_staged(Unit& u);
  void run_direct(Unit& u);
  size_t acquire_slot();
  void release_slot(size_t i);
  void enqueue_from_slot(const Unit& u, Slot& slot);
  void fail_cuda(std::exception_ptr err);
  static std::shared_ptr<const Ranges> source_ranges(const std::vector<Piece>& pieces);
  static void advise_ranges(const Ranges& r);
  void alloc_slots();
  void free_slots();
  void copy_in(const Piece& p, char* dst);
  bool cuda() const { return cfg_.device >= 0; }
  bool in_child() const;

  CopierConfig cfg_;
  std::unique_ptr<Sync> sync_;
  std::shared_ptr<Health> health_;
  pid_t pid_;

  // Guarded by sync_->mu.
  bool closed_ = false;
  bool stop_ = false;
  std::deque<Unit> queue_;
  std::vector<std::thread> threads_;
  std::vector<std::weak_ptr<CopyJob>> live_;  // jobs not yet known finished (fork bookkeeping)

  // Guarded by sync_->slot_mu.
  std::vector<Slot> slots_;
  std::deque<size_t> free_;  // FIFO: taken from the front, given back at the end

  // Held between fork_prepare and fork_parent/fork_child.
  std::vector<std::shared_ptr<CopyJob>> fork_jobs_;

  std::atomic<uint64_t> jobs_{0}, units_{0}, bytes_{0}, faults_{0}, unstaged_bytes_{0};
  std::atomic<uint64_t> read_ns_{0}, submit_ns_{0}, slot_wait_ns_{0};
};

}  // namespace mapoffload
