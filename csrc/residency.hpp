// Page-cache residency of byte spans (mincore(2)) and readahead hints.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace mapoffload {

size_t page_size();
inline uint64_t page_align_down(uint64_t a, uint64_t ps) { return a & ~(ps - 1); }
inline uint64_t page_align_up(uint64_t a, uint64_t ps) { return (a + ps - 1) & ~(ps - 1); }
inline uint64_t bytes_to_pages(uint64_t n, uint64_t ps) { return (n + ps - 1) / ps; }

struct MapsTable;

// Bytes of spans that lie on pages resident in RAM now (mincore(2)).
//
// Unmapped pages count as not resident. Partial first/last pages count only
// the bytes of the span they hold. mincore fails (ENOMEM) on a range with any
// unmapped page, so a span is asked chunk by chunk while every page is
// mapped; from the first chunk that crosses a hole on, only the mapped VMAs of
// a maps snapshot (read once per scanner, on first need) are asked: a span
// across terabytes of unmapped address space costs one /proc read, not one
// system call per page. A snapshot that no longer matches the address space
// (a mapping changed during the call) is re-read at most kMaxRereads times;
// after that a chunk that still fails counts as not resident. Without a
// readable maps file a span counts only the chunks before the first one that
// crosses a hole.
class ResidencyScanner {
 public:
  static constexpr int kMaxRereads = 2;
  // Pages per mincore call: bounds the vector (64k pages = 256 MiB of address space).
  static constexpr uint64_t kChunkPages = uint64_t{1} << 16;
  explicit ResidencyScanner(std::string maps_path = "/proc/self/maps");
  ~ResidencyScanner();
  ResidencyScanner(const ResidencyScanner&) = delete;
  ResidencyScanner& operator=(const ResidencyScanner&) = delete;

  uint64_t resident_bytes(uint64_t addr, uint64_t nbytes);
  // How often the maps file was read (tests).
  int maps_reads() const { return reads_; }

 private:
  // mincore over the page-aligned [lo, hi), adding the bytes of resident pages
  // that fall in [addr, stop) to total. On a chunk with an unmapped page,
  // returns false with that chunk's base in failed_at.
  bool count(uint64_t lo, uint64_t hi, uint64_t addr, uint64_t stop, uint64_t& total, uint64_t& failed_at);
  // (Re-)reads the maps snapshot; false when unreadable or out of re-reads.
  bool read_maps();

  std::string maps_path_;
  std::unique_ptr<MapsTable> maps_;
  int reads_ = 0;
  std::vector<unsigned char> vec_;
  std::vector<uint32_t> touching_;
};

// One span, with a scanner of its own.
uint64_t resident_bytes(uint64_t addr, uint64_t nbytes);

// madvise(MADV_WILLNEED) over the pages of a span: starts kernel readahead
// for file mappings (a no-op for anonymous memory). Errors are ignored: it is
// a hint, and spans that are not mapped have nothing to read ahead.
// The kernel reads at most max(read_ahead_kb, the device's io_pages) per call
// (mm/readahead.c force_page_cache_ra) and silently drops the rest: with
// chunk > 0 the span is asked chunk bytes at a time, so that all of it is read.
void advise_willneed(uint64_t addr, uint64_t nbytes, uint64_t chunk = 0);

// Let go of a span's pages now that they were used (Linux 5.4+):
// madvise(MADV_COLD) moves them to the inactive list, so that reclaim takes
// them before anything else, then madvise(MADV_PAGEOUT) reclaims them at once.
// Clean file pages mapped by this process only leave the page cache (the next
// read goes to the disk); pages other processes map too (other ranks) stay;
// and the kernel skips PAGEOUT for file pages of a file the caller could not
// open for writing (mm/madvise.c can_do_file_pageout) - those are only cold.
// Anonymous pages (a private mapping's written pages) are never discarded:
// without swap they stay. Nothing is read or written. Returns 0, or the errno
// of the first call the kernel refused (EINVAL on kernels without them).
int advise_pageout(uint64_t addr, uint64_t nbytes);

// madvise(MADV_RANDOM) (on) or MADV_NORMAL (off) over a span: with
// MADV_RANDOM a page fault reads only its own page. Without it, a fault on a
// file mapping reads around the faulting address (read_ahead_kb, half of it
// *before* the address: mm/filemap.c do_sync_mmap_readahead), so the first
// fault of a layer brings the end of the layer before it back into the page
// cache, unmapped, where MADV_PAGEOUT (which walks this process's page
// tables) cannot let it go. "on" also sets MADV_HUGEPAGE: a fault on a
// VM_HUGEPAGE|VM_RAND_READ mapping reads exactly the aligned 2 MiB folio that
// holds it (do_sync_mmap_readahead), so MADV_POPULATE_READ reads a span in
// 2 MiB I/Os into large folios, which the compute then walks with far fewer
// TLB misses (MADV_WILLNEED reads into 4 KiB folios: measured 1.3x slower
// matmuls over them). "off" clears MADV_RANDOM only (VM_HUGEPAGE has no
// "back to the default"; it stays a harmless hint). Returns 0 or the errno.
// The kernel splits the mapping's VMA at the span's page boundaries.
// `hugepage` false leaves MADV_HUGEPAGE out: where a fault does not read a
// whole 2 MiB window (kernels before 5.18), it buys nothing, and
// CONFIG_READ_ONLY_THP_FOR_FS's khugepaged could collapse a layer's pages into
// huge folios that straddle its neighbours.
int advise_random(uint64_t addr, uint64_t nbytes, bool on, bool hugepage = true);

// (resident bytes, file size) of a file's pages in the page cache, by mincore
// over a fresh read-only shared mapping (the vmtouch view): nothing is read.
// The file is opened non-blocking, so a FIFO or device answers at once; what
// is not a regular file gives (0, st_size). Throws OsError (maps.hpp) when the
// file cannot be opened or mapped.
std::pair<uint64_t, uint64_t> file_resident_bytes(const std::string& path);

// Resident bytes of the file bytes [first, end) behind an open descriptor
// (a temporary read-only mapping, mincore; reads nothing). -errno on failure.
int64_t fd_range_resident_bytes(int fd, uint64_t first, uint64_t end);

// True when the page holding addr is resident (one mincore call).
bool page_resident(uint64_t addr);

// madvise(MADV_POPULATE_READ): fault a span's pages in with one call instead
// of one fault per page (Linux 5.14+). Pages are mapped readable only, so a
// private mapping's copy-on-write is not broken. Returns 0, or the errno:
// EINVAL where the kernel lacks it, EFAULT where a page cannot be read (a
// file truncated under its mapping: the read that would have been a SIGBUS).
int populate_read(uint64_t addr, uint64_t nbytes);

// MADV_DONTNEED over the pages of [addr, addr + nbytes) that this process maps
// from a file (or does not map at all), read from /proc/self/pagemap: drops
// this process's mappings of them, so that a page another process also maps
// can be dropped from the page cache by whichever process lets it go last
// (MADV_PAGEOUT skips a page more than one process maps). Anonymous pages
// (a weight written in place, copy-on-write) are kept. Returns the bytes
// advised, or -errno.
// Not atomic: a page written by another thread between the read of its
// pagemap entry and the advice is dropped with the write (the kernel offers
// no "drop only if still a file page"). The entries are read 64 pages at a
// time and their runs advised at once, which narrows that window to a few
// microseconds; the caller must still know that nobody writes the span (the
// manager never writes a mapped weight; a streamed layer is let go after it
// ran).
int64_t unmap_file_pages(uint64_t addr, uint64_t nbytes);

// Bytes of the pages of [addr, addr + nbytes) that are this process's own,
// not the file's (from /proc/self/pagemap: present without PM_FILE, or
// swapped): pages of a MAP_PRIVATE file mapping written in place (copy-on-
// write) since they were mapped. Those bytes differ from the file's, so a
// read of the file (O_DIRECT) would not give what the mapping holds. Pages
// not present are the file's (the next touch reads them from it). Returns
// -errno where pagemap cannot be read.
int64_t private_page_bytes(uint64_t addr, uint64_t nbytes);

// Reads a span of a file mapping into the page cache in large I/Os, without
// relying on faults: madvise(MADV_WILLNEED) from the first page not yet
// resident to the span's end, then mincore to see how far the kernel went,
// and again from there. The kernel reads at most max(read_ahead_kb, the
// device's io_pages) per call and silently drops the rest (mm/readahead.c
// force_page_cache_ra), a cap that differs per device and per open file: it
// is measured here, not guessed. mincore counts a page as soon as it is in the
// page cache, I/O still in flight included, so nothing waits for the disk.
// readahead(2) reads only what is asked (no fault-around window): nothing beyond the
// span's first and last page is read. Where a call reads nothing (readahead
// off, memory short) the next starts `step` bytes further; those pages are
// left to the faults. Where the thread's read bytes are not kept, or a file
// system reads without submitting block I/O from this thread (NFS, FUSE),
// only completed reads show progress: the calls then move on by `step`, and
// the reads are `step`-sized. A span across two VMAs has the cap applied per
// VMA, so counting its submitted bytes can skip pages of the first: those are
// left to the faults (a layer's span lies in one VMA unless two mappings sit
// side by side in the address space). Returns the MADV_WILLNEED calls made.
uint64_t read_ahead(uint64_t addr, uint64_t nbytes, uint64_t step = 128 * 1024);

// Faults the span's pages in by reading one byte of each (under the SIGBUS
// guard): what MADV_POPULATE_READ does, for kernels before 5.14. Returns 0, or
// EFAULT with the faulting address in *fault_addr where a page cannot be read.
int touch_pages(uint64_t addr, uint64_t nbytes, uint64_t* fault_addr);

// The run-time probe of how a fault reads a file (see mapoffload/_manager/
// kernel.py): maps [offset, offset+window) of fd read-only; if any of its pages
// is resident, stops there (a warm window tells nothing). Otherwise sets
// MADV_HUGEPAGE (with `hugepage`) + MADV_RANDOM, faults the first page in
// (MADV_POPULATE_READ, or a guarded read where the kernel lacks it) and counts
// the window's resident bytes. Returns (resident before, resident after) in
// bytes; after is 0 when the window was warm. Throws OsError when the window
// cannot be mapped.
std::pair<uint64_t, uint64_t> probe_fault_window(int fd, uint64_t offset, uint64_t window, bool hugepage);

}  // namespace mapoffload
