#include "copier.hpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "fault_guard.hpp"
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

}  // namespace

// --- CopyJob ---------------------------------------------------------------------

void CopyJob::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return remaining_ == 0; });
  if (error_) std::rethrow_exception(error_);
}

bool CopyJob::done() {
  std::lock_guard<std::mutex> lock(mu_);
  return remaining_ == 0;
}

void CopyJob::finish_unit(std::exception_ptr err) {
  std::lock_guard<std::mutex> lock(mu_);
  if (err && !error_) {
    error_ = err;
    failed_.store(true, std::memory_order_relaxed);
  }
  if (--remaining_ == 0) cv_.notify_all();
}

// --- Copier ----------------------------------------------------------------------

Copier::Copier(const CopierConfig& cfg) : cfg_(cfg) {
  if (cfg_.threads == 0) throw std::invalid_argument("threads must be >= 1");
  if (cfg_.slot_bytes < 4096) throw std::invalid_argument("slot bytes must be >= 4096");
  if (cfg_.slots == 0) throw std::invalid_argument("slots must be >= 1");
  if (cfg_.readahead_units == 0) cfg_.readahead_units = cfg_.threads;
  // Direct copies run in submission order on one thread, as the seed does.
  if (cfg_.mode == CopyMode::direct) cfg_.threads = 1;
  install_fault_guard();
  const size_t ps = page_size();
  cfg_.slot_bytes = static_cast<size_t>(page_align_up(cfg_.slot_bytes, ps));
  // Pinned slots and events belong to the copier's device; the caller's
  // current device is restored afterwards (torch tracks it per thread).
  struct DeviceScope {
    int prev = -1;
    explicit DeviceScope(int dev) {
      if (dev < 0) return;
      const CudaApi& api = cuda_api();
      MAPOFFLOAD_CUDA_CHECK(api.GetDevice(&prev));
      MAPOFFLOAD_CUDA_CHECK(api.SetDevice(dev));
    }
    ~DeviceScope() {
      if (prev >= 0) cuda_api().SetDevice(prev);
    }
  } scope(cfg_.device);
  if (cfg_.mode == CopyMode::staged) {
    slots_.resize(cfg_.slots);
    try {
      for (size_t i = 0; i < cfg_.slots; ++i) {
        Slot& s = slots_[i];
        if (cfg_.device >= 0) {
          const CudaApi& api = cuda_api();
          void* p = nullptr;
          MAPOFFLOAD_CUDA_CHECK(api.HostAlloc(&p, cfg_.slot_bytes, kCudaHostAllocPortable));
          s.ptr = static_cast<char*>(p);
          MAPOFFLOAD_CUDA_CHECK(api.EventCreateWithFlags(&s.event, kCudaEventDisableTiming));
        } else {
          s.ptr = static_cast<char*>(std::aligned_alloc(ps, cfg_.slot_bytes));
          if (!s.ptr) throw std::bad_alloc();
        }
        free_.push_back(i);
      }
    } catch (...) {
      free_slots();
      throw;
    }
  }
  for (size_t i = 0; i < cfg_.threads; ++i) threads_.emplace_back([this] { worker(); });
}

Copier::~Copier() {
  try {
    close(true);
  } catch (...) {
  }
}

void Copier::free_slots() {
  for (Slot& s : slots_) {
    if (cfg_.device >= 0) {
      const CudaApi& api = cuda_api();
      if (s.event) {
        if (s.pending) api.EventSynchronize(s.event);
        api.EventDestroy(s.event);
      }
      if (s.ptr) api.FreeHost(s.ptr);
    } else {
      std::free(s.ptr);
    }
    s = Slot{};
  }
  slots_.clear();
  free_.clear();
}

void Copier::close(bool cancel) {
  std::deque<Unit> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = true;
    stop_ = true;
    if (cancel) dropped.swap(queue_);
  }
  cv_.notify_all();
  for (Unit& u : dropped)
    u.job->finish_unit(std::make_exception_ptr(std::runtime_error("copier closed before this copy ran")));
  for (std::thread& t : threads_) t.join();
  threads_.clear();
  free_slots();
}

std::shared_ptr<CopyJob> Copier::submit(const std::vector<CopySpan>& spans, uint64_t stream) {
  std::vector<Unit> units;
  if (cfg_.mode == CopyMode::direct) {
    Unit u;
    u.stream = stream;
    for (const CopySpan& s : spans) {
      if (s.nbytes == 0) continue;
      u.pieces.push_back({s.dst, s.src, s.nbytes, 0, s.src, s.nbytes});
      u.bytes += s.nbytes;
    }
    if (!u.pieces.empty()) units.push_back(std::move(u));
  } else {
    // Pack spans into slot-sized units: large spans are chunked, small spans
    // share a slot back to back.
    Unit cur;
    cur.stream = stream;
    uint64_t fill = 0;
    for (const CopySpan& s : spans) {
      uint64_t off = 0;
      while (off < s.nbytes) {
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
  }
  for (Unit& u : units) u.ranges = source_ranges(u.pieces);
  auto job = std::make_shared<CopyJob>(units.size());
  jobs_.fetch_add(1, std::memory_order_relaxed);
  if (units.empty()) return job;
  for (size_t i = 0; i < units.size() && i < cfg_.readahead_units; ++i) advise_ranges(*units[i].ranges);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) throw std::runtime_error("copier is closed");
    for (Unit& u : units) {
      u.job = job;
      queue_.push_back(std::move(u));
    }
  }
  cv_.notify_all();
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
  if (cfg_.device >= 0) {
    try {
      MAPOFFLOAD_CUDA_CHECK(cuda_api().SetDevice(cfg_.device));
    } catch (...) {
      // Units will fail on their first CUDA call and report it.
    }
  }
  for (;;) {
    Unit u;
    std::shared_ptr<const Ranges> ahead;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      u = std::move(queue_.front());
      queue_.pop_front();
      // Readahead for the unit entering the window `readahead_units` ahead.
      if (queue_.size() >= cfg_.readahead_units) ahead = queue_[cfg_.readahead_units - 1].ranges;
    }
    if (ahead) advise_ranges(*ahead);
    if (u.job->failed()) {  // an earlier unit of this job failed: skip the rest
      u.job->finish_unit(nullptr);
      continue;
    }
    try {
      if (cfg_.mode == CopyMode::staged) run_staged(u);
      else run_direct(u);
      units_.fetch_add(1, std::memory_order_relaxed);
      bytes_.fetch_add(u.bytes, std::memory_order_relaxed);
      u.job->finish_unit(nullptr);
    } catch (...) {
      u.job->finish_unit(std::current_exception());
    }
  }
}

void Copier::copy_in(const Piece& p, char* dst) {
  uint64_t fault = 0;
  if (!guarded_memcpy(dst, reinterpret_cast<const void*>(p.src), p.nbytes, &fault))
    throw MappingFault("SIGBUS reading mapped source bytes " + hex(p.span_src) + "-" + hex(p.span_src + p.span_bytes) +
                       " at " + hex(fault) + ": the file behind the mapping was truncated or is unreadable");
}

size_t Copier::acquire_slot() {
  const uint64_t t0 = now_ns();
  size_t i;
  {
    std::unique_lock<std::mutex> lock(slot_mu_);
    slot_cv_.wait(lock, [&] { return !free_.empty(); });
    i = free_.back();
    free_.pop_back();
  }
  Slot& s = slots_[i];
  if (s.pending) {
    // The last H2D copy out of this slot must finish before it is refilled.
    MAPOFFLOAD_CUDA_CHECK(cuda_api().EventSynchronize(s.event));
    s.pending = false;
  }
  slot_wait_ns_.fetch_add(now_ns() - t0, std::memory_order_relaxed);
  return i;
}

void Copier::release_slot(size_t i) {
  {
    std::lock_guard<std::mutex> lock(slot_mu_);
    free_.push_back(i);
  }
  slot_cv_.notify_one();
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
  try {
    for (const Piece& p : u.pieces) {
      // Cold source (its first page is not in RAM): one call reads and maps
      // the piece's pages instead of a major fault per page inside memcpy.
      // Hot sources skip it: walking present pages costs more than it saves.
      if (p.nbytes >= kPopulateMin && !page_resident(p.src)) populate_read(p.src, p.nbytes);
      copy_in(p, slot.ptr + p.slot_off);
    }
  } catch (const MappingFault&) {
    faults_.fetch_add(1, std::memory_order_relaxed);
    throw;
  }
  uint64_t t1 = now_ns();
  read_ns_.fetch_add(t1 - t0, std::memory_order_relaxed);
  if (cfg_.device >= 0) {
    const CudaApi& api = cuda_api();
    auto stream = reinterpret_cast<cudaStream_t>(u.stream);
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
      k = j;
    }
    MAPOFFLOAD_CUDA_CHECK(api.EventRecord(slot.event, stream));
    slot.pending = true;
  } else {
    for (const Piece& p : u.pieces) std::memcpy(reinterpret_cast<void*>(p.dst), slot.ptr + p.slot_off, p.nbytes);
  }
  submit_ns_.fetch_add(now_ns() - t1, std::memory_order_relaxed);
}

void Copier::run_direct(Unit& u) {
  const uint64_t t0 = now_ns();
  if (cfg_.device >= 0) {
    // The driver reads the source itself (pageable memory is staged inside
    // cudaMemcpyAsync): no SIGBUS guard is possible here.
    const CudaApi& api = cuda_api();
    auto stream = reinterpret_cast<cudaStream_t>(u.stream);
    for (const Piece& p : u.pieces)
      MAPOFFLOAD_CUDA_CHECK(api.MemcpyAsync(reinterpret_cast<void*>(p.dst), reinterpret_cast<const void*>(p.src),
                                            p.nbytes, kCudaMemcpyHostToDevice, stream));
    submit_ns_.fetch_add(now_ns() - t0, std::memory_order_relaxed);
    return;
  }
  try {
    for (const Piece& p : u.pieces) copy_in(p, reinterpret_cast<char*>(p.dst));
  } catch (const MappingFault&) {
    faults_.fetch_add(1, std::memory_order_relaxed);
    throw;
  }
  read_ns_.fetch_add(now_ns() - t0, std::memory_order_relaxed);
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
  return s;
}

}  // namespace mapoffload
