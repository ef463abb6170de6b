#include "copier.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <system_error>

#include "copier_fork.hpp"
#include "fault_guard.hpp"
#include "maps.hpp"
#include "residency.hpp"

namespace mapoffload {

namespace {

uint64_t now_ns() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

std::string hex(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

// Below this, a piece's pages are few and faulting them in memcpy is as cheap.
constexpr uint64_t kPopulateMin = 64 * 1024;
// Direct spans are cut into units of at most this, so that several workers
// share a large one (CPU) and a failure is reported close to where it was.
constexpr uint64_t kDirectUnitBytes = 64ull << 20;

}  // namespace

MappingFault mapping_fault(uint64_t span_src, uint64_t span_bytes, uint64_t fault) {
  const std::string addrs = "mapped at " + hex(span_src) + "-" + hex(span_src + span_bytes);
  try {
    const MapsTable t = read_maps("/proc/self/maps");
    const long i = t.find(fault);
    if (i >= 0 && !t.path(static_cast<size_t>(i)).empty()) {
      const size_t k = static_cast<size_t>(i);
      const uint64_t fault_off = t.offset[k] + (fault - t.start[k]);
      const uint64_t lo = fault_off - std::min(fault_off, fault - span_src);
      // OSError appends ": 'path'" (the exception's filename) to this.
      return MappingFault("SIGBUS reading bytes " + std::to_string(lo) + "-" + std::to_string(lo + span_bytes) +
                              " of a mapped file (" + addrs + "): offset " + std::to_string(fault_off) +
                              " is past its end or unreadable; was the file truncated or replaced while mapped?",
                          t.path(k));
    }
  } catch (...) {
    // The message without the file is still right.
  }
  return MappingFault("SIGBUS reading source bytes " + addrs + " at " + hex(fault) +
                          ": the file behind the mapping was truncated or is unreadable",
                      "");
}

// --- validation -----------------------------------------------------------------

void validate_spans(const std::vector<CopySpan>& spans) {
  struct Iv {
    uint64_t lo, hi;
    size_t index;
    bool dst;
  };
  std::vector<Iv> ivs;
  ivs.reserve(spans.size() * 2);
  for (size_t i = 0; i < spans.size(); ++i) {
    const CopySpan& s = spans[i];
    if (s.nbytes == 0) continue;
    if (s.dst == 0 || s.src == 0) throw std::invalid_argument("span " + std::to_string(i) + " has a null address");
    if (s.dst + s.nbytes < s.dst || s.src + s.nbytes < s.src)
      throw std::invalid_argument("span " + std::to_string(i) + " wraps around the address space");
    ivs.push_back({s.dst, s.dst + s.nbytes, i, true});
    ivs.push_back({s.src, s.src + s.nbytes, i, false});
  }
  std::sort(ivs.begin(), ivs.end(), [](const Iv& a, const Iv& b) { return a.lo < b.lo; });
  // Sweep by start: a destination must not overlap anything; sources may
  // overlap each other (read twice).
  const Iv* far_dst = nullptr;  // the destination seen so far reaching furthest
  const Iv* far_src = nullptr;
  for (const Iv& v : ivs) {
    const Iv* hit = nullptr;
    if (far_dst && v.lo < far_dst->hi) hit = far_dst;
    else if (v.dst && far_src && v.lo < far_src->hi) hit = far_src;
    if (hit) {
      const Iv& a = v.dst ? v : *hit;  // name a destination first
      const Iv& b = v.dst ? *hit : v;
      throw std::invalid_argument("span " + std::to_string(a.index) + ": destination overlaps the " +
                                  (b.dst ? "destination" : "source") + " of span " + std::to_string(b.index));
    }
    const Iv*& far = v.dst ? far_dst : far_src;
    if (!far || v.hi > far->hi) far = &v;
  }
}

// --- Copier ----------------------------------------------------------------------

Copier::Copier(const CopierConfig& cfg)
    : cfg_(cfg), sync_(new Sync), health_(std::make_shared<Health>()), pid_(getpid()) {
  if (cfg_.threads == 0 || cfg_.threads > kMaxThreads)
    throw std::invalid_argument("threads must be in 1.." + std::to_string(kMaxThreads) + ", not " +
                                std::to_string(cfg_.threads));
  if (cfg_.slots == 0 || cfg_.slots > kMaxSlots)
    throw std::invalid_argument("slots must be in 1.." + std::to_string(kMaxSlots) + ", not " +
                                std::to_string(cfg_.slots));
  if (cfg_.slot_bytes < kMinSlotBytes || cfg_.slot_bytes > kMaxSlotBytes)
    throw std::invalid_argument("slot bytes must be in " + std::to_string(kMinSlotBytes) + ".." +
                                std::to_string(kMaxSlotBytes) + ", not " +
                                std::to_string(cfg_.slot_bytes));
  if (cfg_.readahead_units == 0) cfg_.readahead_units = cfg_.threads;
  // Direct copies run in submission order on one thread, as the seed does.
  if (cfg_.mode == CopyMode::direct) cfg_.threads = 1;
  install_fault_guard();
  cfg_.slot_bytes = static_cast<size_t>(page_align_up(cfg_.slot_bytes, page_size()));
  if (cfg_.mode == CopyMode::staged) alloc_slots();
  try {
    start_workers();
  } catch (...) {
    free_slots();
    throw;
  }
  register_copier(this);
}

Copier::~Copier() {
  unregister_copier(this);
  try {
    close(true);
  } catch (...) {
  }
}

bool Copier::in_child() const { return getpid() != pid_; }

void Copier::alloc_slots() {
  DeviceScope scope(cfg_.device);  // pinned slots and events belong to the copier's device
  slots_.resize(cfg_.slots);
  try {
    for (size_t i = 0; i < cfg_.slots; ++i) {
      Slot& s = slots_[i];
      if (cuda()) {
        const CudaApi& api = cuda_api();
        void* p = nullptr;
        MAPOFFLOAD_CUDA_CHECK(api.HostAlloc(&p, cfg_.slot_bytes, kCudaHostAllocPortable));
        s.ptr = static_cast<char*>(p);
        MAPOFFLOAD_CUDA_CHECK(api.EventCreateWithFlags(&s.event, kCudaEventDisableTiming));
      } else {
        s.ptr = static_cast<char*>(std::aligned_alloc(page_size(), cfg_.slot_bytes));
        if (!s.ptr) throw std::bad_alloc();
      }
      free_.push_back(i);
    }
  } catch (...) {
    free_slots();
    throw;
  }
}

void Copier::free_slots() {
  // A forked child cannot call into the parent's CUDA context: leak there.
  const bool can_cuda = cuda() && !in_child();
  for (Slot& s : slots_) {
    if (cuda()) {
      if (!can_cuda) continue;
      const CudaApi& api = cuda_api();
      if (s.event) {
        // The last copy out of the slot must be done before the memory goes.
        if (s.pending && !health_->broken()) api.EventSynchronize(s.event);
        api.EventDestroy(s.event);
      }
      if (s.ptr) api.FreeHost(s.ptr);
    } else {
      std::free(s.ptr);
    }
  }
  slots_.clear();
  free_.clear();
}

void Copier::start_workers() {
  // Called with no worker running and sync_->mu not held (constructor, or
  // the first copy in a forked child, under close_mu).
  std::vector<std::thread> made;
  made.reserve(cfg_.threads);
  try {
    for (size_t i = 0; i < cfg_.threads; ++i) made.emplace_back([this] { worker(); });
  } catch (const std::system_error& e) {
    // Stop the ones that did start, then report; nothing is left running.
    {
      std::lock_guard<std::mutex> lock(sync_->mu);
      stop_ = true;
    }
    sync_->cv.notify_all();
    for (std::thread& t : made) t.join();
    {
      std::lock_guard<std::mutex> lock(sync_->mu);
      stop_ = false;
    }
    throw std::runtime_error("could not start copier worker thread " + std::to_string(made.size() + 1) + " of " +
                             std::to_string(cfg_.threads) + ": " + e.what());
  }
  std::lock_guard<std::mutex> lock(sync_->mu);
  threads_ = std::move(made);
}

void Copier::stop_workers() {
  {
    std::lock_guard<std::mutex> lock(sync_->mu);
    stop_ = true;
  }
  sync_->cv.notify_all();
  {
    std::lock_guard<std::mutex> lock(sync_->slot_mu);
  }
  sync_->slot_cv.notify_all();
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> lock(sync_->mu);
    threads.swap(threads_);
  }
  for (std::thread& t : threads) t.join();
}

bool Copier::closed() const {
  std::lock_guard<std::mutex> lock(sync_->mu);
  return closed_;
}

void Copier::close(bool cancel) {
  std::lock_guard<std::mutex> close_lock(sync_->close_mu);
  std::deque<Unit> dropped;
  {
    std::lock_guard<std::mutex> lock(sync_->mu);
    if (closed_) return;
    closed_ = true;
    if (cancel) dropped.swap(queue_);
  }
  for (Unit& u : dropped)
    u.job->finish_unit(std::make_exception_ptr(std::runtime_error("copier closed before this copy ran")));
  dropped.clear();
  stop_workers();
  std::lock_guard<std::mutex> lock(sync_->slot_mu);
  free_slots();
}

std::vector<Copier::Unit> Copier::make_units(const std::vector<CopySpan>& spans, uint64_t stream) const {
  std::vector<Unit> units;
  const bool all_direct = cfg_.mode == CopyMode::direct;
  // Direct spans: whole spans, cut at kDirectUnitBytes.
  Unit dir;
  dir.stream = stream;
  dir.direct = true;
  // Staged spans: packed into slot-sized units, large spans chunked, small
  // spans sharing a slot back to back.
  Unit cur;
  cur.stream = stream;
  uint64_t fill = 0;
  for (const CopySpan& s : spans) {
    if (s.nbytes == 0) continue;
    if (all_direct || s.direct) {
      for (uint64_t off = 0; off < s.nbytes;) {
        if (dir.bytes >= kDirectUnitBytes) {
          units.push_back(std::move(dir));
          dir = Unit{};
          dir.stream = stream;
          dir.direct = true;
        }
        const uint64_t take = std::min<uint64_t>(kDirectUnitBytes - dir.bytes, s.nbytes - off);
        dir.pieces.push_back({s.dst + off, s.src + off, take, 0, s.src, s.nbytes});
        dir.bytes += take;
        off += take;
      }
      continue;
    }
    for (uint64_t off = 0; off < s.nbytes;) {
      if (fill == cfg_.slot_bytes) {
        units.push_back(std::move(cur));
        cur = Unit{};
        cur.stream = stream;
        fill = 0;
      }
      const uint64_t take = std::min<uint64_t>(cfg_.slot_bytes - fill, s.nbytes - off);
      cur.pieces.push_back({s.dst + off, s.src + off, take, fill, s.src, s.nbytes});
      cur.bytes += take;
      fill += take;
      off += take;
    }
  }
  if (!cur.pieces.empty()) units.push_back(std::move(cur));
  if (!dir.pieces.empty()) units.push_back(std::move(dir));
  for (Unit& u : units) u.ranges = source_ranges(u.pieces);
  return units;
}

std::shared_ptr<CopyJob> Copier::submit(const std::vector<CopySpan>& spans, uint64_t stream,
                                        std::optional<uint64_t> wait_for) {
  validate_spans(spans);
  if (cuda() && in_child())
    throw std::runtime_error(
        "this CUDA copier was made before fork(): CUDA does not survive fork, so it cannot copy in the child "
        "(make copiers after fork, or start workers with the 'spawn' method)");
  health_->rethrow_if_broken();
  std::vector<Unit> units = make_units(spans, stream);
  cudaEvent_t done_event = nullptr;
  if (cuda() && !units.empty()) {
    DeviceScope scope(cfg_.device);
    const CudaApi& api = cuda_api();
    try {
      MAPOFFLOAD_CUDA_CHECK(api.EventCreateWithFlags(&done_event, kCudaEventDisableTiming));
      if (wait_for && *wait_for != stream) {
        // The copies go after what is already queued on wait_for: the stream
        // waits on an event recorded there before any unit is queued.
        cudaEvent_t after = nullptr;
        MAPOFFLOAD_CUDA_CHECK(api.EventCreateWithFlags(&after, kCudaEventDisableTiming));
        cudaError_t e1 = api.EventRecord(after, reinterpret_cast<cudaStream_t>(*wait_for));
        cudaError_t e2 = e1 ? e1 : api.StreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), after, 0);
        api.EventDestroy(after);  // released once the wait is satisfied
        MAPOFFLOAD_CUDA_CHECK(e1);
        MAPOFFLOAD_CUDA_CHECK(e2);
      }
    } catch (...) {
      if (done_event) api.EventDestroy(done_event);
      note_cuda_failure(*health_, std::current_exception());
      throw;
    }
  }
  auto job = std::make_shared<CopyJob>(units.size(), cfg_.device, stream, done_event, health_);
  jobs_.fetch_add(1, std::memory_order_relaxed);
  if (units.empty()) return job;
  for (size_t i = 0; i < units.size() && i < cfg_.readahead_units; ++i) advise_ranges(*units[i].ranges);
  if (in_child()) {
    // A CPU copier in a forked child: its workers stayed in the parent.
    std::lock_guard<std::mutex> close_lock(sync_->close_mu);
    if (in_child()) {
      start_workers();
      pid_ = getpid();
    }
  }
  {
    std::lock_guard<std::mutex> lock(sync_->mu);
    if (stop_ || closed_) throw std::runtime_error("copier is closed");
    // Forget jobs known finished; keep the rest for fork bookkeeping.
    live_.erase(std::remove_if(live_.begin(), live_.end(), [](const std::weak_ptr<CopyJob>& w) {
                  auto j = w.lock();
                  return !j || j->enqueued();
                }),
                live_.end());
    live_.push_back(job);
    for (Unit& u : units) {
      u.job = job;
      queue_.push_back(std::move(u));
    }
  }
  sync_->cv.notify_all();
  return job;
}

std::shared_ptr<const Copier::Ranges> Copier::source_ranges(const std::vector<Piece>& pieces) {
  // Consecutive pieces usually continue one span: advise each run once.
  auto out = std::make_shared<Ranges>();
  for (const Piece& p : pieces) {
    if (!out->empty() && out->back().first + out->back().second == p.src) out->back().second += p.nbytes;
    else out->emplace_back(p.src, p.nbytes);
  }
  return out;
}

void Copier::advise_ranges(const Ranges& r) {
  for (const auto& [src, n] : r) advise_willneed(src, n);
}

void Copier::advise(const std::vector<CopySpan>& spans) const {
  for (const CopySpan& s : spans) advise_willneed(s.src, s.nbytes);
}

void Copier::worker() {
  if (cuda()) {
    try {
      cuda_api().SetDevice(cfg_.device);
    } catch (...) {
      // Units fail on their first CUDA call and report it.
    }
  }
  for (;;) {
    Unit u;
    std::shared_ptr<const Ranges> ahead;
    {
      std::unique_lock<std::mutex> lock(sync_->mu);
      sync_->cv.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      u = std::move(queue_.front());
      queue_.pop_front();
      // Readahead for the unit entering the window `readahead_units` ahead.
      if (queue_.size() >= cfg_.readahead_units) ahead = queue_[cfg_.readahead_units - 1].ranges;
    }
    if (ahead) advise_ranges(*ahead);
    std::exception_ptr err;
    if (!u.job->failed()) {  // an earlier unit of this job failed: skip the rest
      try {
        health_->rethrow_if_broken();
        install_fault_guard();  // still first in line (another library may have installed a handler since)
        if (u.direct) run_direct(u);
        else run_staged(u);
        units_.fetch_add(1, std::memory_order_relaxed);
        bytes_.fetch_add(u.bytes, std::memory_order_relaxed);
      } catch (...) {
        err = std::current_exception();
      }
    }
    u.job->finish_unit(err);
  }
}

void Copier::fail_cuda(std::exception_ptr err) {
  const bool was = health_->broken();
  note_cuda_failure(*health_, err);
  if (!was && health_->broken()) {
    // Wake workers waiting for a slot: they fail fast now.
    { std::lock_guard<std::mutex> lock(sync_->slot_mu); }
    sync_->slot_cv.notify_all();
  }
}

void Copier::copy_in(const Piece& p, char* dst) {
  uint64_t fault = 0;
  if (!guarded_memcpy(dst, reinterpret_cast<const void*>(p.src), p.nbytes, &fault)) {
    faults_.fetch_add(1, std::memory_order_relaxed);
    throw mapping_fault(p.span_src, p.span_bytes, fault);
  }
}

size_t Copier::acquire_slot() {
  const uint64_t t0 = now_ns();
  size_t i;
  {
    std::unique_lock<std::mutex> lock(sync_->slot_mu);
    sync_->slot_cv.wait(lock, [&] { return !free_.empty() || health_->broken(); });
    if (health_->broken()) {
      // Whoever broke it may not have woken every waiter: pass it on.
      sync_->slot_cv.notify_all();
      health_->rethrow_if_broken();
    }
    // The slot given back longest ago: its copy was queued first, so it is
    // the one most likely done. (The last one given back - a stack - is the
    // one least likely done: every refill would wait for the copy just
    // queued, leaving the rest of the ring unused and the host waiting on
    // the DMA even for jobs that fit in the ring.)
    i = free_.front();
    free_.pop_front();
  }
  Slot& s = slots_[i];
  if (s.pending) {
    // The last H2D copy out of this slot must finish before it is refilled.
    // If that cannot be known, the slot goes back still pending (never lost):
    // the next taker asks again.
    try {
      MAPOFFLOAD_CUDA_CHECK(cuda_api().EventSynchronize(s.event));
    } catch (...) {
      release_slot(i);
      fail_cuda(std::current_exception());
      throw;
    }
    s.pending = false;
  }
  slot_wait_ns_.fetch_add(now_ns() - t0, std::memory_order_relaxed);
  return i;
}

void Copier::release_slot(size_t i) {
  {
    std::lock_guard<std::mutex> lock(sync_->slot_mu);
    free_.push_back(i);
  }
  sync_->slot_cv.notify_one();
}

void Copier::enqueue_from_slot(const Unit& u, Slot& slot) {
  const CudaApi& api = cuda_api();
  auto stream = reinterpret_cast<cudaStream_t>(u.stream);
  std::exception_ptr err;
  size_t issued = 0;
  try {
    // Pieces whose destinations continue each other go in one call.
    size_t k = 0;
    while (k < u.pieces.size()) {
      const Piece& first = u.pieces[k];
      uint64_t n = first.nbytes;
      size_t j = k + 1;
      while (j < u.pieces.size() && u.pieces[j].dst == first.dst + n && u.pieces[j].slot_off == first.slot_off + n) {
        n += u.pieces[j].nbytes;
        ++j;
      }
      MAPOFFLOAD_CUDA_CHECK(api.MemcpyAsync(reinterpret_cast<void*>(first.dst), slot.ptr + first.slot_off, n,
                                            kCudaMemcpyHostToDevice, stream));
      ++issued;
      k = j;
    }
  } catch (...) {
    err = std::current_exception();
  }
  if (issued) {
    // Copies out of the slot were queued (all, or some before a failure):
    // the slot is busy until they are done.
    cudaError_t rec = api.EventRecord(slot.event, stream);
    if (rec == kCudaSuccess) {
      slot.pending = true;
    } else if (!err) {
      try {
        check_cuda(rec, "cudaEventRecord(slot)", __FILE__, __LINE__);
      } catch (...) {
        err = std::current_exception();
      }
    }
    if (rec != kCudaSuccess) {
      // The slot's copies cannot be tracked by its event: only a finished
      // stream frees it. If even that cannot be known, nothing can.
      slot.pending = false;
      if (api.StreamSynchronize(stream) != kCudaSuccess) {
        health_->set_broken(err);
        { std::lock_guard<std::mutex> lock(sync_->slot_mu); }
        sync_->slot_cv.notify_all();
      }
    }
  }
  if (err) {
    fail_cuda(err);
    std::rethrow_exception(err);
  }
}

void Copier::run_staged(Unit& u) {
  const size_t si = acquire_slot();
  struct Release {
    Copier* c;
    size_t i;
    ~Release() { c->release_slot(i); }
  } release{this, si};
  Slot& slot = slots_[si];
  uint64_t t0 = now_ns();
  for (const Piece& p : u.pieces) {
    // Cold source (its first page is not in RAM): one call reads and maps
    // the piece's pages instead of a major fault per page inside memcpy.
    // Hot sources skip it: walking present pages costs more than it saves.
    if (p.nbytes >= kPopulateMin && !page_resident(p.src)) populate_read(p.src, p.nbytes);
    copy_in(p, slot.ptr + p.slot_off);
  }
  uint64_t t1 = now_ns();
  read_ns_.fetch_add(t1 - t0, std::memory_order_relaxed);
  if (cuda()) {
    enqueue_from_slot(u, slot);
  } else {
    for (const Piece& p : u.pieces) std::memcpy(reinterpret_cast<void*>(p.dst), slot.ptr + p.slot_off, p.nbytes);
  }
  submit_ns_.fetch_add(now_ns() - t1, std::memory_order_relaxed);
}

void Copier::run_direct(Unit& u) {
  const uint64_t t0 = now_ns();
  if (cuda()) {
    // The DMA engine reads the source itself (pageable memory is staged
    // inside cudaMemcpyAsync): no SIGBUS guard is possible here.
    const CudaApi& api = cuda_api();
    auto stream = reinterpret_cast<cudaStream_t>(u.stream);
    try {
      for (const Piece& p : u.pieces)
        MAPOFFLOAD_CUDA_CHECK(api.MemcpyAsync(reinterpret_cast<void*>(p.dst), reinterpret_cast<const void*>(p.src),
                                              p.nbytes, kCudaMemcpyHostToDevice, stream));
    } catch (...) {
      fail_cuda(std::current_exception());
      throw;
    }
    submit_ns_.fetch_add(now_ns() - t0, std::memory_order_relaxed);
  } else {
    for (const Piece& p : u.pieces) copy_in(p, reinterpret_cast<char*>(p.dst));
    read_ns_.fetch_add(now_ns() - t0, std::memory_order_relaxed);
  }
  unstaged_bytes_.fetch_add(u.bytes, std::memory_order_relaxed);
}

CopyStats Copier::stats() const {
  CopyStats s;
  s.jobs = jobs_.load();
  s.units = units_.load();
  s.bytes = bytes_.load();
  s.faults = faults_.load();
  s.read_ns = read_ns_.load();
  s.submit_ns = submit_ns_.load();
  s.slot_wait_ns = slot_wait_ns_.load();
  s.unstaged_bytes = unstaged_bytes_.load();
  return s;
}

// --- fork -------------------------------------------------------------------------

void Copier::fork_prepare() {
  // Lock order everywhere: close_mu, mu, slot_mu, then job mutexes (leaves).
  sync_->close_mu.lock();
  sync_->mu.lock();
  sync_->slot_mu.lock();
  for (const auto& w : live_)
    if (auto j = w.lock()) fork_jobs_.push_back(std::move(j));
  for (auto& j : fork_jobs_) j->fork_mutex().lock();
}

void Copier::fork_parent() {
  for (auto it = fork_jobs_.rbegin(); it != fork_jobs_.rend(); ++it) (*it)->fork_mutex().unlock();
  fork_jobs_.clear();
  sync_->slot_mu.unlock();
  sync_->mu.unlock();
  sync_->close_mu.unlock();
}

void Copier::fork_child() {
  // Only the forking thread exists here. Jobs in flight in the parent can
  // never finish in the child: fail them, so that waiting on one raises.
  auto err = std::make_exception_ptr(std::runtime_error(
      "the process forked while this copy was in flight: in the child it never completes (wait in the parent)"));
  for (auto& j : fork_jobs_) j->fail_in_child(err);
  fork_jobs_.clear();
  live_.clear();
  queue_.clear();
  // The parent's workers do not exist here; their std::thread objects must
  // be neither joined nor destroyed (std::terminate): leak them.
  (void)new std::vector<std::thread>(std::move(threads_));
  threads_.clear();
  (void)sync_.release();  // locked by fork_prepare; waiters that do not exist
  sync_.reset(new Sync);
  if (cuda()) {
    health_->set_broken(std::make_exception_ptr(std::runtime_error(
        "this CUDA copier was made before fork(): CUDA does not survive fork, so it cannot copy in the child "
        "(make copiers after fork, or start workers with the 'spawn' method)")));
  } else {
    // Slots held by the parent's workers at the fork are free here.
    free_.clear();
    for (size_t i = 0; i < slots_.size(); ++i) free_.push_back(i);
  }
}

}  // namespace mapoffload
