#include "residency.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <vector>

#include "maps.hpp"

namespace mapoffload {

size_t page_size() {
  static const size_t ps = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return ps;
}

// mincore() fails with ENOMEM when any page of the range is unmapped; callers
// fall back to asking page by page so that a span crossing a hole still
// reports the mapped part.
bool page_resident(uint64_t addr) {
  unsigned char v = 0;
  void* page = reinterpret_cast<void*>(page_align_down(addr, page_size()));
  if (mincore(page, page_size(), &v) != 0) return false;
  return v & 1;
}

uint64_t resident_bytes(uint64_t addr, uint64_t nbytes) {
  if (addr == 0 || nbytes == 0 || addr + nbytes < addr) return 0;
  const uint64_t ps = page_size();
  const uint64_t first = page_align_down(addr, ps);
  const uint64_t stop = addr + nbytes;
  const uint64_t npages = bytes_to_pages(stop - first, ps);
  // Chunks bound the vector: 64k pages = 256 MiB of address space per call.
  constexpr uint64_t kChunk = 1 << 16;
  thread_local std::vector<unsigned char> vec;
  uint64_t total = 0;
  for (uint64_t p0 = 0; p0 < npages; p0 += kChunk) {
    const uint64_t n = std::min(kChunk, npages - p0);
    const uint64_t base = first + p0 * ps;
    vec.resize(n);
    bool ok = mincore(reinterpret_cast<void*>(base), n * ps, vec.data()) == 0;
    for (uint64_t k = 0; k < n; ++k) {
      const uint64_t page = base + k * ps;
      bool res = ok ? (vec[k] & 1) : page_resident(page);
      if (!res) continue;
      const uint64_t lo = std::max(page, addr);
      const uint64_t hi = std::min(page + ps, stop);
      total += hi - lo;
    }
  }
  return total;
}

void advise_willneed(uint64_t addr, uint64_t nbytes) {
  if (addr == 0 || nbytes == 0) return;
  const uint64_t ps = page_size();
  const uint64_t lo = page_align_down(addr, ps);
  const uint64_t hi = page_align_up(addr + nbytes, ps);
  (void)madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_WILLNEED);
}

std::pair<uint64_t, uint64_t> file_resident_bytes(const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
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

bool populate_read(uint64_t addr, uint64_t nbytes) {
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
  if (addr == 0 || nbytes == 0) return true;
  const uint64_t ps = page_size();
  const uint64_t lo = page_align_down(addr, ps);
  const uint64_t hi = page_align_up(addr + nbytes, ps);
  return madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_POPULATE_READ) == 0;
}

}  // namespace mapoffload
