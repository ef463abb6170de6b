#include "maps.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <stdexcept>

namespace mapoffload {

const char* vma_class_name(VmaClass c) {
  switch (c) {
    case VmaClass::file: return "file";
    case VmaClass::shmem: return "shmem";
    case VmaClass::anonymous: return "anonymous";
    case VmaClass::special: return "special";
  }
  return "?";
}

const char* span_class_name(SpanClass c) {
  switch (c) {
    case SpanClass::file: return "file";
    case SpanClass::shmem: return "shmem";
    case SpanClass::anonymous: return "anonymous";
    case SpanClass::special: return "special";
    case SpanClass::mixed: return "mixed";
    case SpanClass::unmapped: return "unmapped";
  }
  return "?";
}

namespace {

[[noreturn]] void bad_line(size_t lineno, const std::string& what) {
  throw std::invalid_argument("line " + std::to_string(lineno) + ": " + what);
}

std::string hex_str(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

// Device numbers: dev_t holds 32 bits of major and 32 of minor (the kernel's
// own are 12 and 20), and DevId packs them the same way.
uint64_t check_dev_part(uint64_t v, const char* which, size_t lineno) {
  if (v > 0xffffffffu)
    bad_line(lineno, std::string("device ") + which + " " + hex_str(v) + " does not fit 32 bits");
  return v;
}

// A cursor over one line.
struct Cursor {
  std::string_view s;
  size_t pos = 0;
  size_t lineno;

  bool at_end() const { return pos >= s.size(); }
  void skip_spaces() {
    while (pos < s.size() && (s[pos] == ' ' || s[pos] == '\t')) ++pos;
  }
  uint64_t hex(const char* what) {
    uint64_t v = 0;
    size_t n = 0;
    while (pos < s.size()) {
      char c = s[pos];
      int d;
      if (c >= '0' && c <= '9') d = c - '0';
      else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
      else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
      else break;
      if (n == 16) bad_line(lineno, what);  // more than 64 bits
      v = (v << 4) | static_cast<uint64_t>(d);
      ++pos;
      ++n;
    }
    if (n == 0) bad_line(lineno, what);
    return v;
  }
  uint64_t dec(const char* what) {
    uint64_t v = 0;
    size_t n = 0;
    while (pos < s.size() && s[pos] >= '0' && s[pos] <= '9') {
      uint64_t d = static_cast<uint64_t>(s[pos] - '0');
      if (v > (UINT64_MAX - d) / 10) bad_line(lineno, what);
      v = v * 10 + d;
      ++pos;
      ++n;
    }
    if (n == 0) bad_line(lineno, what);
    return v;
  }
  void expect(char c, const char* what) {
    if (pos >= s.size() || s[pos] != c) bad_line(lineno, what);
    ++pos;
  }
  void expect_space(const char* what) {
    if (pos >= s.size() || (s[pos] != ' ' && s[pos] != '\t')) bad_line(lineno, what);
    skip_spaces();
  }
  std::string_view token() {
    size_t b = pos;
    while (pos < s.size() && s[pos] != ' ' && s[pos] != '\t') ++pos;
    return s.substr(b, pos - b);
  }
};

// Interns paths: consecutive VMAs usually share one, so the last is cached.
struct PathInterner {
  std::vector<std::string>& paths;
  std::unordered_map<std::string, uint32_t> ids;
  std::string last;
  uint32_t last_id = 0;

  explicit PathInterner(std::vector<std::string>& p) : paths(p) {
    paths.assign(1, std::string());
    ids.emplace(std::string(), 0);
  }
  uint32_t operator()(std::string_view p) {
    if (p == last) return last_id;
    last.assign(p.data(), p.size());
    auto it = ids.find(last);
    if (it == ids.end()) {
      it = ids.emplace(last, static_cast<uint32_t>(paths.size())).first;
      paths.push_back(last);
    }
    last_id = it->second;
    return last_id;
  }
};

// Parses one VMA header line ("start-end perms offset dev inode [path]") into t.
void parse_vma_line(std::string_view line, size_t lineno, MapsTable& t, PathInterner& intern) {
  Cursor c{line, 0, lineno};
  uint64_t start = c.hex("bad start address");
  c.expect('-', "expected '-' after the start address");
  uint64_t end = c.hex("bad end address");
  if (end <= start)
    bad_line(lineno, "end address must be above the start address (" + hex_str(start) + "-" + hex_str(end) + ")");
  if (!t.start.empty()) {
    // The kernel prints VMAs in address order, each after the previous one ends.
    if (start < t.start.back())
      throw MapsOrderError("line " + std::to_string(lineno) + ": not sorted: start " + hex_str(start) +
                           " is below the previous mapping's start " + hex_str(t.start.back()));
    if (start < t.end.back())
      throw MapsOrderError("line " + std::to_string(lineno) + ": overlaps the previous mapping, which ends at " +
                           hex_str(t.end.back()));
  }
  c.expect_space("expected permissions");
  std::string_view perm = c.token();
  if (perm.size() != 4) bad_line(lineno, "permissions must be 4 characters");
  uint8_t bits = 0;
  if (perm[0] == 'r') bits |= kRead; else if (perm[0] != '-') bad_line(lineno, "bad permissions");
  if (perm[1] == 'w') bits |= kWrite; else if (perm[1] != '-') bad_line(lineno, "bad permissions");
  if (perm[2] == 'x') bits |= kExec; else if (perm[2] != '-') bad_line(lineno, "bad permissions");
  if (perm[3] == 's') bits |= kShared; else if (perm[3] != 'p') bad_line(lineno, "bad permissions");
  c.expect_space("expected offset");
  uint64_t offset = c.hex("bad offset");
  c.expect_space("expected device");
  uint64_t major = check_dev_part(c.hex("bad device major"), "major", lineno);
  c.expect(':', "expected ':' in device");
  uint64_t minor = check_dev_part(c.hex("bad device minor"), "minor", lineno);
  c.expect_space("expected inode");
  uint64_t inode = c.dec("bad inode");
  std::string_view path;
  if (!c.at_end()) {
    c.expect_space("expected a space before the path");
    path = line.substr(c.pos);
  }
  // The kernel pads the path column; a path never ends in spaces it did not write
  // itself, but trailing padding on a pathless line is common.
  while (!path.empty() && (path.back() == ' ' || path.back() == '\r')) path.remove_suffix(1);

  t.start.push_back(start);
  t.end.push_back(end);
  t.perms.push_back(bits);
  t.offset.push_back(offset);
  t.dev.push_back(make_dev(major, minor));
  t.inode.push_back(inode);
  t.path_id.push_back(intern(path));
}

bool starts_with(std::string_view s, std::string_view p) {
  return s.size() >= p.size() && s.compare(0, p.size(), p) == 0;
}

template <typename F>
void for_each_line(std::string_view text, F&& f) {
  size_t lineno = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string_view::npos) nl = text.size();
    ++lineno;
    std::string_view line = text.substr(pos, nl - pos);
    pos = nl + 1;
    if (line.empty()) continue;
    f(line, lineno);
  }
}

}  // namespace

MapsTable parse_maps(std::string_view text) {
  MapsTable t;
  PathInterner intern(t.paths);
  // Lines are ~80-150 bytes: reserving avoids regrowth on 100k-line inputs.
  size_t guess = text.size() / 64 + 1;
  t.start.reserve(guess); t.end.reserve(guess); t.offset.reserve(guess);
  t.inode.reserve(guess); t.dev.reserve(guess); t.perms.reserve(guess); t.path_id.reserve(guess);
  for_each_line(text, [&](std::string_view line, size_t lineno) {
    parse_vma_line(line, lineno, t, intern);
  });
  classify_vmas(t, FsTypes{});
  return t;
}

MapsTable parse_smaps(std::string_view text) {
  MapsTable t;
  PathInterner intern(t.paths);
  for_each_line(text, [&](std::string_view line, size_t lineno) {
    // Field lines start with a capitalised key followed by ':'; VMA header
    // lines start with a hex address followed by '-'.
    size_t colon = line.find(':');
    size_t dash = line.find('-');
    bool is_field = colon != std::string_view::npos &&
                    (dash == std::string_view::npos || colon < dash) &&
                    line.find(' ') > colon;
    if (!is_field) {
      parse_vma_line(line, lineno, t, intern);
      t.rss.push_back(0); t.anonymous.push_back(0);
      t.private_dirty.push_back(0); t.swap.push_back(0);
      return;
    }
    if (t.start.empty()) bad_line(lineno, "field before the first mapping");
    std::string_view key = line.substr(0, colon);
    std::vector<uint64_t>* dst = nullptr;
    if (key == "Rss") dst = &t.rss;
    else if (key == "Anonymous") dst = &t.anonymous;
    else if (key == "Private_Dirty") dst = &t.private_dirty;
    else if (key == "Swap") dst = &t.swap;
    if (!dst) return;  // VmFlags, THPeligible, ... are not needed
    Cursor c{line, colon + 1, lineno};
    c.skip_spaces();
    uint64_t kb = c.dec("bad field value");
    if (kb > UINT64_MAX / 1024) bad_line(lineno, "value of " + std::string(key) + " does not fit 64 bits in bytes");
    dst->back() = kb * 1024;
  });
  classify_vmas(t, FsTypes{});
  return t;
}

FsTypes parse_mountinfo(std::string_view text) {
  // "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue"
  // Field 3 is major:minor (decimal); the fstype follows the " - " separator.
  FsTypes fs;
  for_each_line(text, [&](std::string_view line, size_t lineno) {
    Cursor c{line, 0, lineno};
    c.dec("bad mount id");
    c.expect_space("expected parent id");
    c.dec("bad parent id");
    c.expect_space("expected major:minor");
    uint64_t major = check_dev_part(c.dec("bad device major"), "major", lineno);
    c.expect(':', "expected ':' in device");
    uint64_t minor = check_dev_part(c.dec("bad device minor"), "minor", lineno);
    size_t sep = line.find(" - ", c.pos);
    if (sep == std::string_view::npos) bad_line(lineno, "missing ' - ' separator");
    Cursor f{line, sep + 3, lineno};
    std::string_view fstype = f.token();
    if (fstype.empty()) bad_line(lineno, "missing filesystem type");
    fs.emplace(make_dev(major, minor), std::string(fstype));
  });
  return fs;
}

VmaClass classify_vma(std::string_view path, uint64_t inode, DevId dev, const FsTypes& fs) {
  if (path.empty()) return inode == 0 ? VmaClass::anonymous : VmaClass::special;
  if (path.front() == '[') {
    if (starts_with(path, "[anon_shmem:")) return VmaClass::shmem;
    if (path == "[heap]" || starts_with(path, "[stack") || starts_with(path, "[anon:"))
      return VmaClass::anonymous;
    return VmaClass::special;  // [vdso], [vvar], [vsyscall], [uprobes], ...
  }
  if (path.front() != '/') return VmaClass::special;  // anon_inode:[perf_event], ...
  // Path rules for tmpfs-backed objects on internal mounts that mountinfo never
  // lists (memfd and SysV live on the kernel's internal shm mount).
  if (starts_with(path, "/memfd:") || starts_with(path, "/SYSV") ||
      starts_with(path, "/dev/zero") || starts_with(path, "/anon_hugepage") ||
      starts_with(path, "/dev/shm/"))
    return VmaClass::shmem;
  auto it = fs.find(dev);
  if (it != fs.end()) {
    const std::string& type = it->second;
    if (type == "tmpfs" || type == "ramfs" || type == "hugetlbfs" || type == "shm")
      return VmaClass::shmem;
    if (type == "devtmpfs" || type == "proc" || type == "sysfs" || type == "debugfs")
      return VmaClass::special;
    return VmaClass::file;
  }
  // Device unknown to the mount table: device nodes stay special.
  if (starts_with(path, "/dev/")) return VmaClass::special;
  return VmaClass::file;
}

void classify_vmas(MapsTable& t, const FsTypes& fs) {
  const size_t n = t.size();
  t.cls.resize(n);
  t.run_end.assign(n, 0);
  for (size_t i = 0; i < n; ++i)
    t.cls[i] = static_cast<uint8_t>(classify_vma(t.path(i), t.inode[i], t.dev[i], fs));
  // Adjacent VMAs of one file (an mprotect split, say) form one run.
  for (size_t k = n; k-- > 0;) {
    if (t.cls[k] != static_cast<uint8_t>(VmaClass::file)) continue;
    uint64_t e = t.end[k];
    if (k + 1 < n && t.cls[k + 1] == static_cast<uint8_t>(VmaClass::file) &&
        t.start[k + 1] == t.end[k] && t.dev[k + 1] == t.dev[k] && t.inode[k + 1] == t.inode[k] &&
        t.path_id[k + 1] == t.path_id[k])
      e = t.run_end[k + 1];
    t.run_end[k] = e;
  }
}

long MapsTable::find(uint64_t addr) const {
  auto it = std::upper_bound(start.begin(), start.end(), addr);
  if (it == start.begin()) return -1;
  size_t i = static_cast<size_t>(it - start.begin()) - 1;
  return addr < end[i] ? static_cast<long>(i) : -1;
}

bool MapsTable::holds_span(uint64_t addr, uint64_t nbytes, size_t& hint) const {
  if (addr == 0 || nbytes == 0) return false;
  if (addr + nbytes < addr) return false;  // wraps the address space
  size_t i = hint;
  if (i >= size() || addr < start[i] || addr >= end[i]) {
    long found = find(addr);
    if (found < 0) return false;
    i = static_cast<size_t>(found);
    hint = i;
  }
  if (cls[i] != static_cast<uint8_t>(VmaClass::file)) return false;
  return addr + nbytes <= run_end[i];
}

SpanClass MapsTable::span_class(uint64_t addr, uint64_t nbytes) const {
  if (addr == 0 || nbytes == 0) return SpanClass::unmapped;
  uint64_t stop = addr + nbytes < addr ? UINT64_MAX : addr + nbytes;
  auto it = std::upper_bound(start.begin(), start.end(), addr);
  size_t i = it == start.begin() ? 0 : static_cast<size_t>(it - start.begin()) - 1;
  if (i < size() && end[i] <= addr) ++i;
  int seen = -1;
  bool gap = false;
  uint64_t cursor = addr;
  for (; i < size() && start[i] < stop; ++i) {
    if (start[i] > cursor) gap = true;
    if (seen < 0) seen = cls[i];
    else if (seen != cls[i]) return SpanClass::mixed;
    cursor = end[i];
  }
  if (seen < 0) return SpanClass::unmapped;
  if (gap || cursor < stop) return SpanClass::mixed;
  return static_cast<SpanClass>(seen);
}

void MapsTable::touching(uint64_t addr, uint64_t nbytes, std::vector<uint32_t>& out) const {
  if (nbytes == 0) return;
  uint64_t stop = addr + nbytes < addr ? UINT64_MAX : addr + nbytes;
  auto it = std::upper_bound(start.begin(), start.end(), addr);
  size_t i = it == start.begin() ? 0 : static_cast<size_t>(it - start.begin()) - 1;
  if (i < size() && end[i] <= addr) ++i;
  for (; i < size() && start[i] < stop; ++i) out.push_back(static_cast<uint32_t>(i));
}

namespace {
template <class Parse>
MapsTable read_ordered(const std::string& path, Parse parse) {
  for (int attempt = 1;; ++attempt) {
    try {
      return parse(read_text_file(path));
    } catch (const MapsOrderError&) {
      if (attempt >= kMapsReads) throw;  // not a torn read: a file that is out of order
    }
  }
}
}  // namespace

MapsTable read_maps(const std::string& path) { return read_ordered(path, [](const std::string& s) { return parse_maps(s); }); }
MapsTable read_smaps(const std::string& path) {
  return read_ordered(path, [](const std::string& s) { return parse_smaps(s); });
}

std::string read_text_file(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "re");
  if (!f) throw OsError{errno, path};
  std::string out;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
  int err = std::ferror(f) ? errno : 0;
  std::fclose(f);
  if (err) throw OsError{err, path};
  return out;
}

}  // namespace mapoffload
