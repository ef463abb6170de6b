// Reading file byte ranges around the page cache (O_DIRECT), into
// destination memory the caller owns.
//
// Under a tight memory cap, reading streamed layers through a mapping
// (MADV_POPULATE_READ, then MADV_PAGEOUT) fights the kernel: readahead and
// reclaim evict pages of the layer in use and read them again. An O_DIRECT
// read goes from the disk straight into the destination: nothing enters the
// page cache, nothing is evicted, each byte is read once.
//
// Layout contract (the same on both paths, so that the caller's tensor views
// do not depend on which path a file took): the byte at file offset `offset`
// lands at `dst + offset % kODirectAlign`. An O_DIRECT read needs its file
// offset, length and memory address aligned to the device's logical block
// size, so the O_DIRECT path reads the kODirectAlign-aligned superset
// [align_down(offset), align_up(offset + length)) into `dst`, which must be
// kODirectAlign-aligned and hold uncached_span(offset, length) bytes. Keeping the
// file offset's residue means an element aligned in the file is aligned in
// memory: tensor views bind to the buffer without another copy.
//
// Where a filesystem refuses O_DIRECT (EINVAL or EOPNOTSUPP from open or from
// pread: ramfs, tmpfs before Linux 6.6, some overlay/FUSE setups) a range is
// read with plain pread and its pages are dropped after the read with
// posix_fadvise(POSIX_FADV_DONTNEED); the result says which path each range
// took.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mapoffload {

// Alignment of O_DIRECT file offsets, lengths and addresses: a multiple of
// every common logical block size (512, 4096); larger ones are refused by the
// kernel with EINVAL and take the buffered path.
constexpr uint64_t kODirectAlign = 4096;
constexpr uint64_t kUncachedMaxIoBytes = uint64_t{1} << 30;
constexpr unsigned kUncachedMaxThreads = 16;

inline uint64_t odirect_align_down(uint64_t a) { return a & ~(kODirectAlign - 1); }
inline uint64_t odirect_align_up(uint64_t a) { return (a + kODirectAlign - 1) & ~(kODirectAlign - 1); }
// Bytes a read of [offset, offset + length) writes from dst on (the aligned superset).
inline uint64_t uncached_span(uint64_t offset, uint64_t length) {
  return length == 0 ? 0 : odirect_align_up(offset % kODirectAlign + length);
}

enum class ReadPath : uint8_t { uncached = 0, buffered = 1 };
const char* read_path_name(ReadPath p);

// A descriptor of our own on the inode behind `fd`.
struct ReadFile {
  int fd = -1;
  ReadPath path = ReadPath::buffered;
  std::string why;  // why the buffered path, "" for uncached
};

// Reopens the open file `fd` through /proc/self/fd/<fd>: the new descriptor
// reaches the same inode even after its path was renamed over or unlinked
// (the magic link follows the open file, not the name), and has file status
// flags of its own, so O_DIRECT never changes the caller's descriptor. With
// want_odirect, O_DIRECT is asked; tmpfs and ramfs are read buffered on
// purpose (their pages are the file's storage: O_DIRECT, where accepted,
// copies from the same pages). A buffered descriptor gets
// POSIX_FADV_RANDOM, so a read brings in the asked bytes and no readahead
// beyond them that the drop after it would miss. Throws OsError when fd is not
// a regular file or cannot be reopened; checks that the new descriptor is the
// same inode (device and inode number).
ReadFile open_for_reading(int fd, bool want_odirect);

struct ReadRange {
  int fd;
  uint64_t offset;
  uint64_t length;
  uint64_t dst;  // kODirectAlign-aligned; holds uncached_span(offset, length) bytes
};

struct RangeResult {
  ReadPath path;
  uint64_t bytes_read;  // bytes the reads transferred (the aligned superset on the O_DIRECT path)
};

// Reads every range (contract above), splitting each into I/Os of at most
// io_bytes (a multiple of kODirectAlign) run by `threads` threads (the calling
// thread and threads - 1 started for this call; none outlive it, so there is
// nothing for a fork to inherit), at most `threads` I/Os in flight. EINTR is
// retried. A descriptor with O_DIRECT whose pread answers EINVAL/EOPNOTSUPP
// loses O_DIRECT (fcntl F_SETFL: it must be the caller's own, from
// open_for_reading) and the range is read buffered. `paths` (empty, or one per
// range) names files in errors; without it /proc/self/fd is asked.
// Throws MappingFault (copy_job.hpp) when a file ends before a range does (a
// truncated file: never a SIGBUS, pread cannot fault), OsError for other I/O
// errors, std::invalid_argument for bad input (checked before any I/O).
std::vector<RangeResult> read_ranges(const std::vector<ReadRange>& ranges, const std::vector<std::string>& paths,
                                     uint64_t io_bytes, unsigned threads);

// Test hook, until called again with zeros: open_for_reading's O_DIRECT open
// fails with `open_errno`, and O_DIRECT preads fail with `pread_errno` (0: the
// real call). Lets tests take the fallbacks on filesystems that accept O_DIRECT.
void inject_uncached_errors(int open_errno, int pread_errno);

}  // namespace mapoffload
