#include "residency.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <cerrno>
#include <stdexcept>
#include <vector>

#include "fault_guard.hpp"
#include "maps.hpp"

namespace mapoffload {

size_t page_size() {
  static const size_t ps = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return ps;
}

// One page (used by the copier to decide whether to populate a span).
bool page_resident(uint64_t addr) {
  unsigned char v = 0;
  void* page = reinterpret_cast<void*>(page_align_down(addr, page_size()));
  if (mincore(page, page_size(), &v) != 0) return false;
  return v & 1;
}

ResidencyScanner::ResidencyScanner(std::string maps_path) : maps_path_(std::move(maps_path)) {}

ResidencyScanner::~ResidencyScanner() = default;

bool ResidencyScanner::read_maps() {
  if (reads_ > kMaxRereads) return false;
  ++reads_;
  try {
    MapsTable fresh = mapoffload::read_maps(maps_path_);
    maps_ = std::make_unique<MapsTable>(std::move(fresh));
    return true;
  } catch (const OsError&) {
  } catch (const std::invalid_argument&) {
  }
  return false;
}

bool ResidencyScanner::count(uint64_t lo, uint64_t hi, uint64_t addr, uint64_t stop, uint64_t& total,
                             uint64_t& failed_at) {
  const uint64_t ps = page_size();
  for (uint64_t base = lo; base < hi;) {
    const uint64_t n = std::min(kChunkPages, (hi - base) / ps);
    vec_.resize(n);
    if (mincore(reinterpret_cast<void*>(base), n * ps, vec_.data()) != 0) {
      failed_at = base;
      return false;
    }
    for (uint64_t k = 0; k < n; ++k) {
      if (!(vec_[k] & 1)) continue;
      const uint64_t page = base + k * ps;
      total += std::min(page + ps, stop) - std::max(page, addr);
    }
    base += n * ps;
  }
  return true;
}

uint64_t ResidencyScanner::resident_bytes(uint64_t addr, uint64_t nbytes) {
  if (addr == 0 || nbytes == 0) return 0;
  const uint64_t ps = page_size();
  // A span running past the top of the address space stops at its last page.
  const uint64_t top = page_align_down(UINT64_MAX, ps);
  if (addr >= top) return 0;
  const uint64_t stop = nbytes > top - addr ? top : addr + nbytes;
  const uint64_t lo = page_align_down(addr, ps);
  const uint64_t hi = page_align_up(stop, ps);
  uint64_t total = 0, cursor = lo;
  if (count(lo, hi, addr, stop, total, cursor)) return total;
  // From `cursor` on, the span crosses a hole: ask only the mapped VMAs.
  if (!maps_ && !read_maps()) return total;
  while (cursor < hi) {
    touching_.clear();
    maps_->touching(cursor, hi - cursor, touching_);
    uint64_t failed_at = hi;
    bool stale = false;
    for (uint32_t i : touching_) {
      const uint64_t plo = std::max(maps_->start[i], cursor);
      const uint64_t phi = std::min(maps_->end[i], hi);
      // [vsyscall] lies above the task's address space: mincore refuses it.
      if (plo >= phi || maps_->path(i) == "[vsyscall]") continue;
      if (!count(plo, phi, addr, stop, total, failed_at)) {
        stale = true;
        break;
      }
    }
    if (!stale) break;
    // The snapshot no longer matches the address space: re-read it and resume
    // at the chunk that failed, or, out of re-reads, count that chunk as not
    // resident. Either way the cursor moves on or a re-read is spent.
    if (read_maps()) {
      cursor = failed_at;
    } else {
      cursor = failed_at + std::min(hi - failed_at, kChunkPages * ps);
    }
  }
  return total;
}

uint64_t resident_bytes(uint64_t addr, uint64_t nbytes) {
  ResidencyScanner scanner;
  return scanner.resident_bytes(addr, nbytes);
}

void advise_willneed(uint64_t addr, uint64_t nbytes, uint64_t chunk) {
  if (addr == 0 || nbytes == 0 || addr + nbytes < addr) return;
  const uint64_t ps = page_size();
  const uint64_t lo = page_align_down(addr, ps);
  const uint64_t hi = page_align_up(addr + nbytes, ps);
  const uint64_t step = chunk ? std::max(ps, page_align_down(chunk, ps)) : hi - lo;
  for (uint64_t a = lo; a < hi; a += std::min(step, hi - a)) {
    (void)madvise(reinterpret_cast<void*>(a), std::min(step, hi - a), MADV_WILLNEED);
  }
}

int64_t fd_range_resident_bytes(int fd, uint64_t first, uint64_t end) {
  if (end <= first) return 0;
  const uint64_t ps = page_size();
  const uint64_t lo = page_align_down(first, ps);
  void* p = mmap(nullptr, end - lo, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(lo));
  if (p == MAP_FAILED) return -errno;
  const uint64_t res = resident_bytes(reinterpret_cast<uint64_t>(p) + (first - lo), end - first);
  munmap(p, end - lo);
  return static_cast<int64_t>(res);
}

std::pair<uint64_t, uint64_t> file_resident_bytes(const std::string& path) {
  // O_NONBLOCK: opening a FIFO without a writer would otherwise wait forever.
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw OsError{errno, path};
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int err = errno;
    close(fd);
    throw OsError{err, path};
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size == 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return {0, size};
  }
  void* p = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  if (p == MAP_FAILED) throw OsError{err, path};
  const uint64_t res = resident_bytes(reinterpret_cast<uint64_t>(p), size);
  munmap(p, size);
  return {res, size};
}

#ifndef MADV_COLD
#define MADV_COLD 20
#endif
#ifndef MADV_PAGEOUT
#define MADV_PAGEOUT 21
#endif
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

namespace {
// madvise over the pages a span touches: 0, the errno, or EINVAL for a span
// that wraps the address space. An empty span or a null address asks nothing.
int advise_pages(uint64_t addr, uint64_t nbytes, int advice) {
  if (addr == 0 || nbytes == 0) return 0;
  if (addr + nbytes < addr) return EINVAL;
  const uint64_t ps = page_size();
  const uint64_t lo = page_align_down(addr, ps);
  const uint64_t hi = page_align_up(addr + nbytes, ps);
  return madvise(reinterpret_cast<void*>(lo), hi - lo, advice) == 0 ? 0 : errno;
}
}  // namespace

int advise_pageout(uint64_t addr, uint64_t nbytes) {
  int err = advise_pages(addr, nbytes, MADV_COLD);
  int out = advise_pages(addr, nbytes, MADV_PAGEOUT);
  return err ? err : out;
}

int advise_random(uint64_t addr, uint64_t nbytes, bool on, bool hugepage) {
  // A hint only: kernels without file THP refuse it, and the span still streams.
  if (on && hugepage) (void)advise_pages(addr, nbytes, MADV_HUGEPAGE);
  return advise_pages(addr, nbytes, on ? MADV_RANDOM : MADV_NORMAL);
}

int populate_read(uint64_t addr, uint64_t nbytes) { return advise_pages(addr, nbytes, MADV_POPULATE_READ); }

namespace {
// Walks the pagemap entries (/proc/self/pagemap, 8 bytes a page) of the pages
// of [addr, addr + nbytes), `batch` at a time: own(page, mine) for each page,
// `mine` when the page is this process's own rather than the file's (present
// without PM_FILE: a private copy written in place, copy-on-write; or
// swapped out), then batch_done(end) once per batch read. Returns 0, or the
// errno of the open or read that failed.
template <typename OnPage, typename OnBatch>
int walk_pagemap(uint64_t addr, uint64_t nbytes, uint64_t batch, OnPage&& on_page, OnBatch&& batch_done) {
  const uint64_t ps = page_size();
  const uint64_t lo = page_align_down(addr, ps);
  const uint64_t hi = page_align_up(addr + nbytes, ps);
  const int fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno;
  constexpr uint64_t kPresent = 1ull << 63, kSwapped = 1ull << 62, kFileOrShared = 1ull << 61;
  std::vector<uint64_t> entries(batch);
  int err = 0;
  for (uint64_t a = lo; a < hi && err == 0;) {
    const uint64_t n = std::min<uint64_t>(entries.size(), (hi - a) / ps);
    const ssize_t got = pread(fd, entries.data(), n * sizeof(uint64_t), static_cast<off_t>((a / ps) * 8));
    if (got <= 0) {
      err = got < 0 ? errno : EIO;
      break;
    }
    const uint64_t m = static_cast<uint64_t>(got) / sizeof(uint64_t);
    for (uint64_t k = 0; k < m; ++k, a += ps) {
      const uint64_t e = entries[k];
      on_page(a, (e & kSwapped) || ((e & kPresent) && !(e & kFileOrShared)));
    }
    if (batch_done(a) != 0) break;
  }
  close(fd);
  return err;
}
}  // namespace

// Pages whose pagemap entries are read at once before their droppable runs are
// advised: a page written (turned anonymous) between the read and the advice
// would be dropped with its write, so the two stay as close as the syscalls
// allow (see residency.hpp).
constexpr uint64_t kUnmapBatchPages = 64;

int64_t unmap_file_pages(uint64_t addr, uint64_t nbytes) {
  if (addr == 0 || nbytes == 0) return 0;
  if (addr + nbytes < addr) return -EINVAL;
  int64_t advised = 0;
  int err = 0;
  uint64_t run = 0;  // first page of the current run of droppable pages (0: none)
  auto flush = [&](uint64_t end) {
    if (run == 0) return;
    if (madvise(reinterpret_cast<void*>(run), end - run, MADV_DONTNEED) == 0)
      advised += static_cast<int64_t>(end - run);
    else if (err == 0)
      err = errno;
    run = 0;
  };
  const int read_err = walk_pagemap(
      addr, nbytes, kUnmapBatchPages,
      [&](uint64_t page, bool mine) {
        // A private copy (written in place) or swapped out: dropping it would lose the write; it stays.
        if (mine)
          flush(page);
        else if (run == 0)
          run = page;
      },
      [&](uint64_t end) {
        flush(end);  // at once: the entries just read are what it may drop
        return err;
      });
  if (err == 0) err = read_err;
  return err ? -err : advised;
}

int64_t private_page_bytes(uint64_t addr, uint64_t nbytes) {
  if (addr == 0 || nbytes == 0) return 0;
  if (addr + nbytes < addr) return -EINVAL;
  const uint64_t ps = page_size();
  int64_t found = 0;
  const int err = walk_pagemap(
      addr, nbytes, 512, [&](uint64_t, bool mine) { found += mine ? static_cast<int64_t>(ps) : 0; },
      [](uint64_t) { return 0; });
  return err ? -err : found;
}

namespace {
// The first page of the page-aligned [lo, hi) that mincore does not report
// resident; hi when all are, lo when mincore fails (an unmapped hole: nothing
// is known). mincore reports a page cache page only once it is up to date
// (mm/mincore.c mincore_page): a page whose read is still in flight counts as
// absent here.
uint64_t first_absent(uint64_t lo, uint64_t hi, std::vector<unsigned char>& vec) {
  const uint64_t ps = page_size();
  for (uint64_t base = lo; base < hi;) {
    const uint64_t n = std::min(ResidencyScanner::kChunkPages, (hi - base) / ps);
    vec.resize(n);
    if (mincore(reinterpret_cast<void*>(base), n * ps, vec.data()) != 0) return base;
    for (uint64_t k = 0; k < n; ++k) {
      if (!(vec[k] & 1)) return base + k * ps;
    }
    base += n * ps;
  }
  return hi;
}

// Bytes this thread has submitted for reading from storage
// (/proc/thread-self/io read_bytes; block/blk-core.c submit_bio accounts a
// read to the submitting task when it is submitted, not when it completes),
// or -1 where the kernel does not keep it (CONFIG_TASK_IO_ACCOUNTING off).
int64_t thread_read_bytes() {
  int fd = open("/proc/thread-self/io", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  char buf[512];
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return -1;
  buf[n] = 0;
  const char* p = std::strstr(buf, "\nread_bytes:");
  if (!p) return -1;
  return std::strtoll(p + 12, nullptr, 10);
}
}  // namespace

uint64_t read_ahead(uint64_t addr, uint64_t nbytes, uint64_t step) {
  if (addr == 0 || nbytes == 0 || addr + nbytes < addr) return 0;
  const uint64_t ps = page_size();
  const uint64_t lo = page_align_down(addr, ps);
  const uint64_t hi = page_align_up(addr + nbytes, ps);
  step = std::max(ps, page_align_down(step, ps));
  std::vector<unsigned char> vec;
  uint64_t calls = 0;
  for (uint64_t a = first_absent(lo, hi, vec); a < hi;) {
    // One call reads [a, a + cap) of what is not in the page cache yet. How
    // far it went is measured two ways: the bytes it submitted (a lower
    // bound of its reach: pages already cached in that range cost nothing),
    // and the pages now up to date (mincore: reads that already completed).
    const int64_t r0 = thread_read_bytes();
    (void)madvise(reinterpret_cast<void*>(a), hi - a, MADV_WILLNEED);
    ++calls;
    const int64_t r1 = thread_read_bytes();
    uint64_t next = first_absent(a, hi, vec);
    if (r0 >= 0 && r1 > r0) next = std::max(next, std::min(hi, a + page_align_down(r1 - r0, ps)));
    // No progress: readahead is off or memory is short here; move on.
    if (next <= a) next = std::min(hi, a + step);
    a = first_absent(next, hi, vec);
  }
  return calls;
}

int touch_pages(uint64_t addr, uint64_t nbytes, uint64_t* fault_addr) {
  if (addr == 0 || nbytes == 0) return 0;
  if (addr + nbytes < addr) return EINVAL;
  const uint64_t ps = page_size();
  const uint64_t lo = page_align_down(addr, ps);
  const uint64_t hi = page_align_up(addr + nbytes, ps);
  install_fault_guard();
  // Only the span's own bytes are read: its first byte, then each next page's first.
  uint64_t start = addr;
  if (!guarded_touch(reinterpret_cast<const void*>(start), 1, 1, fault_addr)) return EFAULT;
  start = lo + ps;
  if (start < hi && start < addr + nbytes) {
    if (!guarded_touch(reinterpret_cast<const void*>(start), addr + nbytes - start, ps, fault_addr)) return EFAULT;
  }
  return 0;
}

std::pair<uint64_t, uint64_t> probe_fault_window(int fd, uint64_t offset, uint64_t window, bool hugepage) {
  const uint64_t ps = page_size();
  if (window == 0 || offset % ps || window % ps) throw std::invalid_argument("probe window must be whole pages");
  void* p = mmap(nullptr, window, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(offset));
  if (p == MAP_FAILED) throw OsError{errno, "probe mapping"};
  const uint64_t a = reinterpret_cast<uint64_t>(p);
  const uint64_t before = resident_bytes(a, window);
  uint64_t after = 0;
  if (before == 0) {
    if (hugepage) (void)madvise(p, window, MADV_HUGEPAGE);
    (void)madvise(p, window, MADV_RANDOM);
    if (populate_read(a, ps) == EINVAL) {
      uint64_t fault = 0;
      (void)touch_pages(a, 1, &fault);
    }
    after = resident_bytes(a, window);
  }
  munmap(p, window);
  return {before, after};
}

}  // namespace mapoffload
