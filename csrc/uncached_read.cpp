#include "uncached_read.hpp"

#include <errno.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <system_error>
#include <thread>

#include "copy_job.hpp"  // MappingFault
#include "maps.hpp"      // OsError

namespace mapoffload {

namespace {

std::atomic<int> g_inject_open{0};
std::atomic<int> g_inject_pread{0};

// The filesystem refuses O_DIRECT for this file or this request.
bool refuses_odirect(int err) { return err == EINVAL || err == EOPNOTSUPP || err == ENOTSUP; }

std::string fd_path(int fd) {
  char link[64], buf[4096];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(link, buf, sizeof buf - 1);
  if (n <= 0) return "<fd " + std::to_string(fd) + ">";
  return std::string(buf, static_cast<size_t>(n));
}

int open_proc_fd(int fd, int flags) {
  char link[64];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  int r;
  do {
    r = ::open(link, flags);
  } while (r < 0 && errno == EINTR);
  return r;
}

// Drops the O_DIRECT flag of our own descriptor: the filesystem refused a
// O_DIRECT read. Later calls read buffered at once.
void drop_odirect(int fd) {
  int fl = fcntl(fd, F_GETFL);
  if (fl >= 0 && (fl & O_DIRECT)) {
    fcntl(fd, F_SETFL, fl & ~O_DIRECT);
    posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
  }
}

// One I/O: file bytes [lo, hi) (aligned) of range r, into dst + (lo - base).
struct Chunk {
  uint32_t range;
  uint64_t lo, hi;
};

struct Team {
  const std::vector<ReadRange>& ranges;
  const std::vector<std::string>& paths;
  std::vector<Chunk> chunks;
  std::vector<uint8_t> odirect;             // per range: fd had O_DIRECT at the start of the call
  std::unique_ptr<std::atomic<uint8_t>[]> fell_back;  // per range: a chunk was read buffered
  std::unique_ptr<std::atomic<uint64_t>[]> bytes;     // per range: bytes transferred
  std::atomic<size_t> next{0};
  std::atomic<bool> stop{false};
  std::mutex err_mu;
  std::exception_ptr err;

  Team(const std::vector<ReadRange>& r, const std::vector<std::string>& p) : ranges(r), paths(p) {}

  std::string path_of(uint32_t i) const { return paths.empty() ? fd_path(ranges[i].fd) : paths[i]; }

  void fail(std::exception_ptr e) {
    std::lock_guard<std::mutex> g(err_mu);
    if (!err) err = e;
    stop.store(true, std::memory_order_relaxed);
  }

  // Reads [from, to) of the file into dst + (from - base), until `to` or the
  // end of the file; returns where the bytes read end. On the O_DIRECT path
  // every request starts at an aligned offset (`from` is aligned; a short
  // aligned read continues where it stopped; an unaligned one is the end of
  // the file). After a fallback the rest is read buffered from where it stopped.
  uint64_t pread_all(uint32_t i, bool& use_odirect, uint64_t from, uint64_t to, uint64_t base) {
    const ReadRange& r = ranges[i];
    uint64_t got = from;
    while (got < to) {
      uint64_t at = use_odirect ? odirect_align_down(got) : got;
      char* dst = reinterpret_cast<char*>(r.dst) + (at - base);
      ssize_t n;
      int inject = use_odirect ? g_inject_pread.load(std::memory_order_relaxed) : 0;
      if (inject) {
        n = -1;
        errno = inject;
      } else {
        n = ::pread(r.fd, dst, static_cast<size_t>(to - at), static_cast<off_t>(at));
      }
      if (n < 0) {
        int e = errno;
        if (e == EINTR) continue;
        if (use_odirect && refuses_odirect(e)) {
          drop_odirect(r.fd);
          use_odirect = false;
          fell_back[i].store(1, std::memory_order_relaxed);
          continue;  // the same bytes, buffered
        }
        throw OsError{e, path_of(i)};
      }
      bytes[i].fetch_add(static_cast<uint64_t>(n), std::memory_order_relaxed);
      if (n == 0 || at + static_cast<uint64_t>(n) <= got) break;  // the end of the file
      got = at + static_cast<uint64_t>(n);
      // An O_DIRECT read ends unaligned only at the end of the file.
      if (use_odirect && got % kODirectAlign) break;
    }
    return got;
  }

  void run_chunk(const Chunk& c) {
    const ReadRange& r = ranges[c.range];
    const uint64_t base = odirect_align_down(r.offset), want_end = r.offset + r.length;
    // Asked per I/O: another range on the same descriptor may have lost O_DIRECT.
    int fl = odirect[c.range] ? fcntl(r.fd, F_GETFL) : 0;
    bool use_odirect = fl >= 0 && (fl & O_DIRECT);
    if (odirect[c.range] && !use_odirect) fell_back[c.range].store(1, std::memory_order_relaxed);
    uint64_t got;
    if (use_odirect) {
      got = pread_all(c.range, use_odirect, c.lo, c.hi, base);
    } else {
      got = c.lo;  // nothing read yet
    }
    // Buffered: only the wanted bytes of the chunk; then let their pages go.
    const uint64_t wlo = std::max(c.lo, r.offset), whi = std::min(c.hi, want_end);
    if (!use_odirect && whi > wlo) {
      uint64_t from = std::max(wlo, std::min(got, whi));
      if (from < whi) got = pread_all(c.range, use_odirect, from, whi, base);
      else got = whi;
      // Pages partly outside [wlo, whi) are kept by the kernel (it drops whole
      // pages only): at most one at each end of a range, shared with its
      // neighbour in the file.
      posix_fadvise(r.fd, static_cast<off_t>(wlo), static_cast<off_t>(whi - wlo), POSIX_FADV_DONTNEED);
    }
    const uint64_t need = std::min(c.hi, want_end);
    if (got < need) {
      struct stat st {};
      std::string size = fstat(r.fd, &st) == 0 ? std::to_string(st.st_size) : "?";
      std::string path = path_of(c.range);
      throw MappingFault(path + ": the file ends before the bytes asked of it (it is " + size +
                             " bytes; reading [" + std::to_string(r.offset) + ", " + std::to_string(want_end) +
                             ") stopped at byte " + std::to_string(got) + "): truncated?",
                         path);
    }
  }

  void work() {
    for (;;) {
      if (stop.load(std::memory_order_relaxed)) return;
      size_t k = next.fetch_add(1, std::memory_order_relaxed);
      if (k >= chunks.size()) return;
      try {
        run_chunk(chunks[k]);
      } catch (...) {
        fail(std::current_exception());
        return;
      }
    }
  }
};

}  // namespace

const char* read_path_name(ReadPath p) { return p == ReadPath::uncached ? "uncached" : "buffered"; }

void inject_uncached_errors(int open_errno, int pread_errno) {
  g_inject_open.store(open_errno);
  g_inject_pread.store(pread_errno);
}

ReadFile open_for_reading(int fd, bool want_odirect) {
  struct stat st {};
  if (fstat(fd, &st) != 0) throw OsError{errno, "<fd " + std::to_string(fd) + ">"};
  if (!S_ISREG(st.st_mode)) throw OsError{EINVAL, fd_path(fd)};
  ReadFile out;
  if (want_odirect) {
    struct statfs sf {};
    if (fstatfs(fd, &sf) == 0 &&
        (sf.f_type == static_cast<decltype(sf.f_type)>(TMPFS_MAGIC) ||
         sf.f_type == static_cast<decltype(sf.f_type)>(RAMFS_MAGIC))) {
      out.why = "tmpfs/ramfs: the file's pages are its storage (O_DIRECT there reads the same pages, or is refused)";
    } else {
      int inject = g_inject_open.load();
      int nfd = inject ? -1 : open_proc_fd(fd, O_RDONLY | O_CLOEXEC | O_DIRECT);
      int e = inject ? inject : errno;
      if (nfd >= 0) {
        out.fd = nfd;
        out.path = ReadPath::uncached;
      } else if (refuses_odirect(e)) {
        out.why = "the filesystem refuses O_DIRECT (" + std::string(strerror(e)) + ")";
      } else if (e != ENOENT && e != EACCES && e != EPERM) {
        throw OsError{e, fd_path(fd)};
      }
    }
  } else {
    out.why = "O_DIRECT not asked";
  }
  if (out.fd < 0) {
    int nfd = open_proc_fd(fd, O_RDONLY | O_CLOEXEC);
    if (nfd >= 0) {
      posix_fadvise(nfd, 0, 0, POSIX_FADV_RANDOM);
    } else {
      // No /proc: a duplicate shares the caller's open file (and its status
      // flags and readahead mode, which are then left alone).
      nfd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
      if (nfd < 0) throw OsError{errno, fd_path(fd)};
      out.why += out.why.empty() ? "/proc/self/fd cannot be opened" : "; /proc/self/fd cannot be opened";
    }
    out.fd = nfd;
    out.path = ReadPath::buffered;
  }
  struct stat nst {};
  if (fstat(out.fd, &nst) != 0 || nst.st_dev != st.st_dev || nst.st_ino != st.st_ino) {
    int e = errno;
    std::string p = fd_path(fd);
    ::close(out.fd);
    throw OsError{e ? e : ESTALE, p};
  }
  return out;
}

std::vector<RangeResult> read_ranges(const std::vector<ReadRange>& ranges, const std::vector<std::string>& paths,
                                     uint64_t io_bytes, unsigned threads) {
  if (io_bytes < kODirectAlign || io_bytes % kODirectAlign || io_bytes > kUncachedMaxIoBytes)
    throw std::invalid_argument("io_bytes must be a multiple of " + std::to_string(kODirectAlign) + " up to " +
                                std::to_string(kUncachedMaxIoBytes) + ", not " + std::to_string(io_bytes));
  if (threads < 1 || threads > kUncachedMaxThreads)
    throw std::invalid_argument("threads must be 1.." + std::to_string(kUncachedMaxThreads) + ", not " +
                                std::to_string(threads));
  if (!paths.empty() && paths.size() != ranges.size())
    throw std::invalid_argument("paths: " + std::to_string(paths.size()) + " for " + std::to_string(ranges.size()) +
                                " ranges");
  Team team(ranges, paths);
  team.odirect.resize(ranges.size());
  team.fell_back.reset(new std::atomic<uint8_t>[ranges.size()]);
  team.bytes.reset(new std::atomic<uint64_t>[ranges.size()]);
  std::vector<std::pair<uint64_t, uint64_t>> dsts;  // [dst, dst + span) of each range
  for (size_t i = 0; i < ranges.size(); ++i) {
    const ReadRange& r = ranges[i];
    team.fell_back[i].store(0);
    team.bytes[i].store(0);
    int fl = fcntl(r.fd, F_GETFL);
    if (fl < 0) throw OsError{errno, paths.empty() ? "<fd " + std::to_string(r.fd) + ">" : paths[i]};
    team.odirect[i] = (fl & O_DIRECT) != 0;
    if (r.length == 0) continue;
    if (r.offset + r.length < r.offset) throw std::invalid_argument("range " + std::to_string(i) + " wraps around");
    if (r.dst == 0 || r.dst % kODirectAlign)
      throw std::invalid_argument("range " + std::to_string(i) + ": the destination must be " +
                                  std::to_string(kODirectAlign) + "-aligned");
    const uint64_t lo = odirect_align_down(r.offset), hi = odirect_align_up(r.offset + r.length);
    dsts.emplace_back(r.dst, r.dst + (hi - lo));
    for (uint64_t c = lo; c < hi; c += io_bytes)
      team.chunks.push_back({static_cast<uint32_t>(i), c, std::min(hi, c + io_bytes)});
  }
  std::sort(dsts.begin(), dsts.end());
  for (size_t k = 1; k < dsts.size(); ++k)
    if (dsts[k].first < dsts[k - 1].second)
      throw std::invalid_argument("the destinations of two ranges overlap (each writes its aligned superset)");

  const size_t extra = std::min<size_t>(threads, team.chunks.size()) > 0
                           ? std::min<size_t>(threads, team.chunks.size()) - 1
                           : 0;
  std::vector<std::thread> helpers;
  helpers.reserve(extra);
  try {
    for (size_t t = 0; t < extra; ++t)
      helpers.emplace_back([&team] {
        // Asynchronous signals (Ctrl-C) go to the threads that handle them, not to a helper.
        sigset_t all;
        sigfillset(&all);
        pthread_sigmask(SIG_BLOCK, &all, nullptr);
        team.work();
      });
  } catch (const std::system_error&) {
    // A thread could not be started: the threads there are do the work.
  }
  team.work();
  for (auto& h : helpers) h.join();
  if (team.err) std::rethrow_exception(team.err);

  std::vector<RangeResult> out(ranges.size());
  for (size_t i = 0; i < ranges.size(); ++i)
    out[i] = {team.odirect[i] && !team.fell_back[i].load() ? ReadPath::uncached : ReadPath::buffered,
              team.bytes[i].load()};
  return out;
}

}  // namespace mapoffload
