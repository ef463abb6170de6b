// Pure parsers for /proc/<pid>/maps, /proc/<pid>/mountinfo and /proc/<pid>/smaps,
// and the sorted interval index built from them.
//
// Everything here is a function of text: reading /proc is done by a thin
// wrapper (read_text_file) so that the parsers are tested on hand-written
// fixtures.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace mapoffload {

// What the kernel can do with the pages of a VMA under memory pressure.
enum class VmaClass : uint8_t {
  // A real file on a disk (or network/overlay) filesystem: clean pages are page
  // cache the kernel can drop and re-read. A deleted-but-still-mapped file on
  // such a filesystem stays in this class: its inode lives until unmapped and
  // its clean pages can still be dropped and re-read from the disk blocks.
  file = 0,
  // tmpfs-backed (memfd, /dev/zero shared, SysV shm, /dev/shm, other tmpfs,
  // ramfs, hugetlbfs): looks like a file, but the pages cannot be dropped
  // without swap.
  shmem = 1,
  // No backing object: no path, [heap], [stack], [anon:name].
  anonymous = 2,
  // [vdso], [vvar], [vsyscall], device files, anon_inode: mappings.
  special = 3,
};

// Class of a byte span as a whole (reports).
enum class SpanClass : uint8_t {
  file = 0,
  shmem = 1,
  anonymous = 2,
  special = 3,
  mixed = 4,     // covered by VMAs of different classes, or partly unmapped
  unmapped = 5,  // no byte is mapped (also: empty span or null address)
};

const char* vma_class_name(VmaClass c);
const char* span_class_name(SpanClass c);

// Permission bits as parsed from the "rwxp"/"rwxs" column.
enum PermBits : uint8_t { kRead = 1, kWrite = 2, kExec = 4, kShared = 8 };

// Device number as the kernel prints it: (major << 32) | minor.
using DevId = uint64_t;
inline DevId make_dev(uint64_t major, uint64_t minor) { return (major << 32) | minor; }

// Mount device -> filesystem type, from /proc/self/mountinfo.
using FsTypes = std::unordered_map<DevId, std::string>;

// Sorted, non-overlapping interval arrays (structure of arrays), one entry per VMA.
struct MapsTable {
  std::vector<uint64_t> start, end, offset, inode;
  std::vector<DevId> dev;
  std::vector<uint8_t> perms;
  std::vector<uint32_t> path_id;     // index into paths
  std::vector<std::string> paths;    // distinct paths; paths[0] == ""
  std::vector<uint8_t> cls;          // VmaClass
  // For file VMAs: end address of the run of address-adjacent VMAs of the same
  // file (same dev and inode) that this VMA starts. 0 for other classes.
  std::vector<uint64_t> run_end;

  // smaps extras (empty unless parsed from smaps): bytes.
  std::vector<uint64_t> rss, anonymous, private_dirty, swap;

  size_t size() const { return start.size(); }
  const std::string& path(size_t i) const { return paths[path_id[i]]; }

  // Index of the VMA holding `addr`, or -1.
  long find(uint64_t addr) const;
  // True when every byte of [addr, addr+nbytes) lies in file VMAs of one run.
  bool holds_span(uint64_t addr, uint64_t nbytes) const {
    size_t hint = 0;
    return holds_span(addr, nbytes, hint);
  }
  // The same, for spans asked in a row: `hint` is the VMA the previous span
  // started in (0 at first), checked before searching (a model's tensors come
  // in file order, so most spans start in the VMA of the one before).
  bool holds_span(uint64_t addr, uint64_t nbytes, size_t& hint) const;
  SpanClass span_class(uint64_t addr, uint64_t nbytes) const;
  // Indices of VMAs that overlap [addr, addr+nbytes), appended to out.
  void touching(uint64_t addr, uint64_t nbytes, std::vector<uint32_t>& out) const;
};

// Parse /proc/<pid>/maps text. Throws std::invalid_argument("line N: ...") on
// a malformed line, and on text the kernel never prints: an empty or inverted
// VMA, a start below the previous start (unsorted) or below the previous end
// (overlapping), a device major or minor beyond 32 bits. Classes are path
// rules only until classify_vmas() is called with the mount table.
MapsTable parse_maps(std::string_view text);

// Parse /proc/<pid>/smaps: VMA header lines as in maps, then "Key: N kB" lines.
MapsTable parse_smaps(std::string_view text);

// Thrown by the parsers for VMAs out of address order (unsorted or overlapping). In a
// /proc file read while another thread maps or unmaps, a VMA split or merged between two
// read() calls shows twice or overlaps: the kernel serves each read() from a fresh walk.
struct MapsOrderError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// Read and parse a maps (or smaps) file, read again while the text is out of address order
// (a torn read, see MapsOrderError; up to kMapsReads reads, then the last error is thrown).
constexpr int kMapsReads = 16;
MapsTable read_maps(const std::string& path);
MapsTable read_smaps(const std::string& path);

// Parse /proc/<pid>/mountinfo: the "major:minor" (decimal, 32 bits each) and
// fstype fields.
FsTypes parse_mountinfo(std::string_view text);

// Class of one VMA from its path, inode and the filesystem its device is on.
VmaClass classify_vma(std::string_view path, uint64_t inode, DevId dev, const FsTypes& fs);

// Fill cls and run_end of every VMA.
void classify_vmas(MapsTable& t, const FsTypes& fs);

// Read a whole file (works for /proc files that report size 0).
// Throws OsError on failure.
struct OsError {
  int err;
  std::string path;
};
std::string read_text_file(const std::string& path);

}  // namespace mapoffload
