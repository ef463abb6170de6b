// PYBIND11_MODULE(_core): glue only. Inputs are converted under the GIL; the
// batched work runs with the GIL released.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>

#include "uncached_read.hpp"
#include "fp8.hpp"
#include "fp8_lookup.hpp"
#include "maps.hpp"
#include "residency.hpp"
#include "py_helpers.hpp"
#include "spans.hpp"

namespace py = pybind11;
using namespace mapoffload;

namespace {

SpanArray make_spans(const py::object& addrs, const py::object& sizes) {
  SpanArray s;
  s.addr = to_u64_vector(addrs, "addrs");
  s.nbytes = to_u64_vector(sizes, "sizes");
  if (s.addr.size() != s.nbytes.size())
    throw py::value_error("addrs and sizes differ in length: " + std::to_string(s.addr.size()) +
                          " != " + std::to_string(s.nbytes.size()));
  return s;
}

// A path or other OS string as str, the way os.fsdecode decodes it
// (surrogateescape): never raises for bytes that are not UTF-8.
py::object fs_str(const std::string& s) {
  PyObject* o = PyUnicode_DecodeFSDefaultAndSize(s.data(), static_cast<Py_ssize_t>(s.size()));
  if (!o) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(o);
}

// A filesystem path from str, bytes or os.PathLike (os.fsencode semantics).
std::string fs_path(const py::object& path) {
  PyObject* bytes = nullptr;
  if (!PyUnicode_FSConverter(path.ptr(), &bytes)) throw py::error_already_set();
  py::bytes owned = py::reinterpret_steal<py::bytes>(bytes);
  return std::string(owned);
}

// /proc text from bytes, or from str (os.fsencode: surrogate escapes round-trip).
std::string proc_text(const py::object& text) {
  if (PyBytes_Check(text.ptr())) return std::string(py::reinterpret_borrow<py::bytes>(text));
  if (!PyUnicode_Check(text.ptr())) throw py::type_error("text must be str or bytes");
  py::bytes b = py::reinterpret_steal<py::bytes>(PyUnicode_EncodeFSDefault(text.ptr()));
  if (!b) throw py::error_already_set();
  return std::string(b);
}

// Paths of the distinct path ids, decoded once (os.fsdecode: never raises).
py::list decoded_paths(const MapsTable& t) {
  std::vector<py::object> distinct(t.paths.size());
  for (size_t k = 0; k < t.paths.size(); ++k) distinct[k] = fs_str(t.paths[k]);
  py::list out(t.size());
  for (size_t i = 0; i < t.size(); ++i) {
    PyObject* p = distinct[t.path_id[i]].ptr();
    Py_INCREF(p);
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), p);
  }
  return out;
}

SpanArray extract(const py::object& seq, const py::object& tensor_type, bool check_device) {
  SpanArray s;
  if (!extract_tensor_spans(seq.ptr(), tensor_type.ptr(), check_device, s)) throw py::error_already_set();
  return s;
}

std::vector<uint8_t> holds_all(const MapsTable& t, const SpanArray& s) {
  std::vector<uint8_t> out(s.size());
  py::gil_scoped_release nogil;
  size_t hint = 0;
  for (size_t i = 0; i < s.size(); ++i) out[i] = t.holds_span(s.addr[i], s.nbytes[i], hint);
  return out;
}

std::vector<ReadRange> make_ranges(const py::object& fds, const py::object& offsets, const py::object& lengths,
                                   const py::object& dsts) {
  std::vector<uint64_t> f = to_u64_vector(fds, "fds"), o = to_u64_vector(offsets, "offsets"),
                        n = to_u64_vector(lengths, "lengths"), d = to_u64_vector(dsts, "dsts");
  if (f.size() != o.size() || f.size() != n.size() || f.size() != d.size())
    throw py::value_error("fds, offsets, lengths and dsts differ in length: " + std::to_string(f.size()) + ", " +
                          std::to_string(o.size()) + ", " + std::to_string(n.size()) + ", " +
                          std::to_string(d.size()));
  std::vector<ReadRange> out(f.size());
  for (size_t i = 0; i < f.size(); ++i) {
    if (f[i] > static_cast<uint64_t>(INT32_MAX)) throw py::value_error("fds: not a descriptor: " + std::to_string(f[i]));
    if (o[i] > static_cast<uint64_t>(INT64_MAX) || n[i] > static_cast<uint64_t>(INT64_MAX) - o[i])
      throw py::value_error("range " + std::to_string(i) + ": offset + length beyond a file's size");
    out[i] = {static_cast<int>(f[i]), o[i], n[i], d[i]};
  }
  return out;
}

MapsTable with_mounts(MapsTable t, const std::string& mountinfo_path) {
  // The mount table only refines classes (tmpfs vs disk); without it the path
  // rules still apply.
  try {
    classify_vmas(t, parse_mountinfo(read_text_file(mountinfo_path)));
  } catch (const OsError&) {
  }
  return t;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "mapoffload native core: /proc maps index, residency, copy engine";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const OsError& e) {
      py::object err = py::module_::import("builtins").attr("OSError")(
          e.err, std::string(std::strerror(e.err)), fs_str(e.path));
      PyErr_SetObject(PyExc_OSError, err.ptr());
    }
  });

  m.def("page_size", [] { return page_size(); });

  // Reading uncached (csrc/uncached_read.hpp).
  m.attr("O_DIRECT_ALIGN") = kODirectAlign;
  m.def("uncached_span", &uncached_span, py::arg("offset"), py::arg("length"),
        "Bytes read_ranges writes at a range's destination: the O_DIRECT_ALIGN-aligned superset of "
        "[offset, offset + length); the byte at `offset` lands at dst + offset % O_DIRECT_ALIGN.");
  m.def("open_for_reading", [](int fd, bool uncached) {
    ReadFile f;
    {
      py::gil_scoped_release nogil;
      f = open_for_reading(fd, uncached);
    }
    return py::make_tuple(f.fd, read_path_name(f.path), f.why);
  }, py::arg("fd"), py::arg("uncached") = true,
     "(new fd, 'uncached' | 'buffered', why) : the inode behind fd reopened through /proc/self/fd (it "
     "follows the open file, not its path), with O_DIRECT where the filesystem takes it. The caller closes "
     "the new fd. tmpfs/ramfs are read buffered on purpose; why says why a file is buffered ('' if uncached).");
  m.def("read_ranges", [](const py::object& fds, const py::object& offsets, const py::object& lengths,
                          const py::object& dsts, uint64_t io_bytes, unsigned threads, const py::object& paths) {
    std::vector<ReadRange> ranges = make_ranges(fds, offsets, lengths, dsts);
    std::vector<std::string> names;
    if (!paths.is_none())
      for (const py::handle& p : paths) names.push_back(fs_path(py::reinterpret_borrow<py::object>(p)));
    std::vector<RangeResult> res;
    {
      py::gil_scoped_release nogil;
      res = read_ranges(ranges, names, io_bytes, threads);
    }
    py::list out(res.size());
    for (size_t i = 0; i < res.size(); ++i) out[i] = py::make_tuple(read_path_name(res[i].path), res[i].bytes_read);
    return out;
  }, py::arg("fds"), py::arg("offsets"), py::arg("lengths"), py::arg("dsts"), py::kw_only(),
     py::arg("io_bytes") = uint64_t{4} << 20, py::arg("threads") = 2u, py::arg("paths") = py::none(),
     "Read file bytes [offset, offset + length) of each fd to dsts[i] + offset % O_DIRECT_ALIGN (dsts "
     "O_DIRECT_ALIGN-aligned, uncached_span bytes each, not overlapping), with the GIL released, in I/Os of "
     "io_bytes on `threads` threads. O_DIRECT fds (open_for_reading) read uncached; others, and "
     "O_DIRECT fds the filesystem refuses (they lose O_DIRECT), read with pread, then POSIX_FADV_DONTNEED. "
     "Returns ('uncached' | 'buffered', bytes transferred) per range. A file that ends before its range raises "
     "MappingFaultError naming it; other I/O errors OSError.");
  // Fused FP8 dequantization (csrc/fp8.hpp).
  m.def("dequantize_fp8", [](uint64_t codes, uint64_t scale, uint64_t out, uint64_t lead, uint64_t rows,
                             uint64_t cols, uint64_t scale_lead, uint64_t srows, uint64_t scols,
                             const std::string& fp8_format, const std::string& out_dtype, unsigned bf16_nan,
                             unsigned threads, bool simd) {
    if (bf16_nan > 0xFFFF) throw py::value_error("bf16_nan must be a 16-bit pattern, not " + std::to_string(bf16_nan));
    Fp8Job j;
    j.codes = codes, j.scale = scale, j.out = out;
    j.lead = lead, j.rows = rows, j.cols = cols, j.scale_lead = scale_lead, j.srows = srows, j.scols = scols;
    j.format = parse_fp8_format(fp8_format);
    j.out_dtype = parse_fp8_out(out_dtype);
    j.bf16_nan = static_cast<uint16_t>(bf16_nan);
    j.threads = threads;
    j.simd = simd;
    check_fp8_job(j);
    py::gil_scoped_release nogil;
    dequantize_fp8(j);
  }, py::arg("codes"), py::arg("scale"), py::arg("out"), py::kw_only(), py::arg("lead"), py::arg("rows"),
     py::arg("cols"), py::arg("scale_lead"), py::arg("srows"), py::arg("scols"), py::arg("fp8_format"),
     py::arg("out_dtype"), py::arg("bf16_nan") = 0x7FC0u, py::arg("threads") = 0u, py::arg("simd") = true,
     "out[e,i,j] = round(value(codes[e,i,j]) * scale[e or 0, i/(rows/srows), j/(cols/scols)]) for lead x rows x "
     "cols fp8 codes (bytes, row-major, fp8_format 'e4m3fn' | 'e5m2') and float32 scales (row-major), into out "
     "('bfloat16' | 'float16' | 'float32', row-major): one float32 multiply, rounded to nearest even; every NaN "
     "becomes bf16_nan in bfloat16. Addresses are data_ptr() ints; the GIL is released; rows are split across "
     "`threads` threads (0: one; mapoffload.fp8 passes its default), one below 256 Ki elements (2 Mi with the SIMD lookup). Bad sizes, addresses or overlaps raise "
     "ValueError; a SIGBUS reading the codes or scales (a truncated mapped file) MappingFaultError. simd=False "
     "runs the portable loop where the CPU has a SIMD one (fp8_simd()); the bits are the same.");
  m.def("fp8_simd", &fp8_lookup_isa,
        "The SIMD table lookup dequantize_fp8 uses on this CPU: 'avx512vbmi', or '' (the portable loop).");
  m.def("_inject_uncached_errors", &inject_uncached_errors, py::arg("open_errno") = 0, py::arg("pread_errno") = 0,
        "Tests: make the O_DIRECT open / O_DIRECT preads fail with these errnos until called with zeros.");
  bind_copier(m);

  py::class_<SpanArray>(m, "SpanArray", "Byte spans (address, nbytes) as native arrays.")
      .def(py::init(&make_spans), py::arg("addrs"), py::arg("sizes"))
      .def("__len__", &SpanArray::size)
      .def_property_readonly("addrs", [](const SpanArray& s) { return int_list(s.addr); })
      .def_property_readonly("sizes", [](const SpanArray& s) { return int_list(s.nbytes); })
      .def_property_readonly("total_bytes", [](const SpanArray& s) -> py::object {
        uint64_t t = 0;
        bool wrapped = false;
        for (uint64_t n : s.nbytes) wrapped |= __builtin_add_overflow(t, n, &t);
        if (!wrapped) return py::int_(t);
        py::object total = py::int_(0);  // beyond 64 bits: Python ints
        for (uint64_t n : s.nbytes) total = total + py::int_(n);
        return total;
      });

  m.def("extract_spans", &extract, py::arg("tensors"), py::arg("tensor_type"),
        py::arg("check_device") = true,
        "(data_ptr, extent) of every tensor in one call: the bytes its strides can reach; "
        "non-CPU/meta/empty -> (0, 0).");
  m.def("tensor_extent", [](const py::object& tensor, const py::object& tensor_type, bool check_device) {
    uint64_t addr = 0, nbytes = 0;
    if (!extract_tensor_extent(tensor.ptr(), tensor_type.ptr(), check_device, addr, nbytes))
      throw py::error_already_set();
    return py::make_tuple(addr, nbytes);
  }, py::arg("tensor"), py::arg("tensor_type"), py::arg("check_device") = true,
     "(data_ptr, extent) of one tensor, as extract_spans computes it.");

  py::class_<MapsTable>(m, "MapsTable", "Sorted interval arrays of one maps/smaps snapshot.")
      .def("__len__", &MapsTable::size)
      .def_property_readonly("starts", [](const MapsTable& t) { return int_list(t.start); })
      .def_property_readonly("ends", [](const MapsTable& t) { return int_list(t.end); })
      .def_property_readonly("offsets", [](const MapsTable& t) { return int_list(t.offset); })
      .def_property_readonly("inodes", [](const MapsTable& t) { return int_list(t.inode); })
      .def_property_readonly("run_ends", [](const MapsTable& t) { return int_list(t.run_end); })
      .def_property_readonly("rss", [](const MapsTable& t) { return int_list(t.rss); })
      .def_property_readonly("anonymous", [](const MapsTable& t) { return int_list(t.anonymous); })
      .def_property_readonly("private_dirty", [](const MapsTable& t) { return int_list(t.private_dirty); })
      .def_property_readonly("swap", [](const MapsTable& t) { return int_list(t.swap); })
      .def_property_readonly("devs", [](const MapsTable& t) {
        py::list out;
        for (DevId d : t.dev) out.append(py::make_tuple(d >> 32, d & 0xffffffffu));
        return out;
      })
      .def_property_readonly("perms", [](const MapsTable& t) {
        py::list out;
        for (uint8_t b : t.perms) {
          char s[5] = {b & kRead ? 'r' : '-', b & kWrite ? 'w' : '-', b & kExec ? 'x' : '-',
                       b & kShared ? 's' : 'p', 0};
          out.append(py::str(s));
        }
        return out;
      })
      .def_property_readonly("paths", &decoded_paths,
                             "Path of each VMA, decoded as os.fsdecode does (surrogate escapes).")
      .def_property_readonly("classes", [](const MapsTable& t) {
        py::list out;
        for (uint8_t c : t.cls) out.append(py::str(vma_class_name(static_cast<VmaClass>(c))));
        return out;
      })
      .def("apply_mountinfo", [](MapsTable& t, const py::object& text) {
        classify_vmas(t, parse_mountinfo(proc_text(text)));
      }, py::arg("text"), "Re-classify every VMA with this mount table (tmpfs vs disk).")
      .def("find", &MapsTable::find, py::arg("addr"), "Index of the VMA holding addr, or -1.")
      .def("holds_pointer", [](const MapsTable& t, uint64_t p) { return t.holds_span(p, 1); },
           py::arg("ptr"))
      .def("holds_spans", [](const MapsTable& t, const SpanArray& s) { return bool_list(holds_all(t, s)); },
           py::arg("spans"))
      .def("classify_tensors", [](const MapsTable& t, const py::object& seq, const py::object& type,
                                  bool check_device) {
        // check_device reads is_cpu through the cached descriptor (~20 ns a tensor).
        SpanArray s = extract(seq, type, check_device);
        std::vector<uint8_t> held = holds_all(t, s);
        return bool_list(held);
      }, py::arg("tensors"), py::arg("tensor_type"), py::arg("check_device") = true,
         "Extract spans (GIL held), then classify (GIL released): holds() for each tensor.")
      .def("span_classes", [](const MapsTable& t, const SpanArray& s) {
        std::vector<uint8_t> c(s.size());
        {
          py::gil_scoped_release nogil;
          for (size_t i = 0; i < s.size(); ++i)
            c[i] = static_cast<uint8_t>(t.span_class(s.addr[i], s.nbytes[i]));
        }
        py::list out(c.size());
        for (size_t i = 0; i < c.size(); ++i)
          out[i] = py::str(span_class_name(static_cast<SpanClass>(c[i])));
        return out;
      }, py::arg("spans"))
      .def("touching", [](const MapsTable& t, const SpanArray& s) {
        std::vector<uint32_t> idx;
        {
          py::gil_scoped_release nogil;
          for (size_t i = 0; i < s.size(); ++i) t.touching(s.addr[i], s.nbytes[i], idx);
          std::sort(idx.begin(), idx.end());
          idx.erase(std::unique(idx.begin(), idx.end()), idx.end());
        }
        return int_list(idx);
      }, py::arg("spans"), "Sorted indices of the VMAs that overlap any span.");

  m.def("parse_maps", [](const py::object& text) { return parse_maps(proc_text(text)); }, py::arg("text"),
        "Parse /proc/<pid>/maps text, str or bytes (path rules only; see MapsTable.apply_mountinfo).");
  m.def("parse_smaps", [](const py::object& text) { return parse_smaps(proc_text(text)); }, py::arg("text"));
  m.def("parse_mountinfo", [](const py::object& text) {
    py::dict out;
    for (auto& kv : parse_mountinfo(proc_text(text)))
      out[py::make_tuple(kv.first >> 32, kv.first & 0xffffffffu)] = kv.second;
    return out;
  }, py::arg("text"), "(major, minor) -> filesystem type.");

  m.def("snapshot", [](const py::object& maps_path, const py::object& mountinfo_path) {
    std::string maps = fs_path(maps_path), mounts = fs_path(mountinfo_path);
    py::gil_scoped_release nogil;
    return with_mounts(read_maps(maps), mounts);
  }, py::arg("maps_path") = "/proc/self/maps", py::arg("mountinfo_path") = "/proc/self/mountinfo",
     "Read and index one maps snapshot. Raises OSError when maps_path is unreadable.");
  m.def("read_smaps", [](const py::object& smaps_path, const py::object& mountinfo_path) {
    std::string smaps = fs_path(smaps_path), mounts = fs_path(mountinfo_path);
    py::gil_scoped_release nogil;
    return with_mounts(read_smaps(smaps), mounts);
  }, py::arg("smaps_path") = "/proc/self/smaps", py::arg("mountinfo_path") = "/proc/self/mountinfo");

  m.def("resident_bytes", [](const SpanArray& s, const py::object& maps_path) {
    std::vector<uint64_t> out(s.size());
    std::string maps = fs_path(maps_path);
    {
      py::gil_scoped_release nogil;
      ResidencyScanner scanner(maps);
      for (size_t i = 0; i < s.size(); ++i) out[i] = scanner.resident_bytes(s.addr[i], s.nbytes[i]);
    }
    return int_list(out);
  }, py::arg("spans"), py::arg("maps_path") = "/proc/self/maps",
     "Bytes of each span on pages resident in RAM now (mincore). Unmapped holes are skipped "
     "through a maps snapshot read from maps_path on first need.");
  m.def("fd_range_resident_bytes", [](int fd, uint64_t first, uint64_t end) {
    py::gil_scoped_release nogil;
    return fd_range_resident_bytes(fd, first, end);
  }, py::arg("fd"), py::arg("first"), py::arg("end"),
     "Resident bytes of the file bytes [first, end) behind fd (mincore over a temporary mapping; reads "
     "nothing), or -errno.");
  m.def("file_resident_bytes", [](const py::object& path) {
    std::string p = fs_path(path);
    py::gil_scoped_release nogil;
    return file_resident_bytes(p);
  }, py::arg("path"), "(resident bytes, size) of a file in the page cache; reads nothing. "
     "A FIFO or other non-regular file gives (0, st_size) without blocking.");
  m.def("advise_willneed", [](const SpanArray& s, uint64_t chunk) {
    py::gil_scoped_release nogil;
    for (size_t i = 0; i < s.size(); ++i) advise_willneed(s.addr[i], s.nbytes[i], chunk);
  }, py::arg("spans"), py::arg("chunk") = 0,
     "madvise(MADV_WILLNEED) over each span: start readahead. The kernel reads at most its readahead "
     "size per call: chunk > 0 asks that many bytes at a time, so that the whole span is read.");
  m.def("populate_read", [](const SpanArray& s) {
    std::pair<int, uint64_t> first{0, 0};
    {
      py::gil_scoped_release nogil;
      for (size_t i = 0; i < s.size() && first.first == 0; ++i) {
        first = {populate_read(s.addr[i], s.nbytes[i]), s.addr[i]};
      }
    }
    return first.first ? first : std::pair<int, uint64_t>{0, 0};
  }, py::arg("spans"),
     "madvise(MADV_POPULATE_READ) over each span: read its pages in and map them, one call per span "
     "(Linux 5.14+). Returns (0, 0), or (errno, start of the span) of the first that failed: EINVAL where "
     "the kernel lacks it, EFAULT where a page cannot be read (a truncated file). Stops at the first failure.");
  m.def("advise_random", [](const SpanArray& s, bool on, bool hugepage) {
    py::gil_scoped_release nogil;
    int first = 0;
    for (size_t i = 0; i < s.size(); ++i) {
      int err = advise_random(s.addr[i], s.nbytes[i], on, hugepage);
      if (first == 0) first = err;
    }
    return first;
  }, py::arg("spans"), py::arg("on") = true, py::arg("hugepage") = true,
     "madvise(MADV_RANDOM) (on) or MADV_NORMAL (off) over each span: faults read their own page only, "
     "no readahead. With on and hugepage, MADV_HUGEPAGE first. Returns 0 or the errno of the first refusal.");
  m.def("read_ahead", [](const SpanArray& s, uint64_t step) {
    py::gil_scoped_release nogil;
    uint64_t calls = 0;
    for (size_t i = 0; i < s.size(); ++i) calls += read_ahead(s.addr[i], s.nbytes[i], step);
    return calls;
  }, py::arg("spans"), py::arg("step") = 128 * 1024,
     "Read each span into the page cache in large I/Os (MADV_WILLNEED from the first page not resident, "
     "as far as the kernel goes per call, measured with mincore). Returns the MADV_WILLNEED calls made.");
  m.def("touch_pages", [](const SpanArray& s) {
    std::pair<int, uint64_t> first{0, 0};
    {
      py::gil_scoped_release nogil;
      for (size_t i = 0; i < s.size() && first.first == 0; ++i) {
        uint64_t fault = 0;
        int err = touch_pages(s.addr[i], s.nbytes[i], &fault);
        if (err) first = {err, fault ? fault : s.addr[i]};
      }
    }
    return first;
  }, py::arg("spans"),
     "Fault each span's pages in by reading a byte of each, under the SIGBUS guard (kernels without "
     "MADV_POPULATE_READ). Returns (0, 0), or (EFAULT, faulting address) for a page that cannot be read.");
  m.def("probe_fault_window", [](int fd, uint64_t offset, uint64_t window, bool hugepage) {
    py::gil_scoped_release nogil;
    return probe_fault_window(fd, offset, window, hugepage);
  }, py::arg("fd"), py::arg("offset"), py::arg("window"), py::arg("hugepage") = true,
     "(resident bytes before, after) of the file window [offset, offset+window) when one fault on its "
     "first page, under MADV_HUGEPAGE + MADV_RANDOM, is all that reads it; after is 0 for a warm window.");
  m.def("advise_pageout", [](const SpanArray& s) {
    py::gil_scoped_release nogil;
    int first = 0;
    for (size_t i = 0; i < s.size(); ++i) {
      int err = advise_pageout(s.addr[i], s.nbytes[i]);
      if (first == 0) first = err;
    }
    return first;
  }, py::arg("spans"),
     "madvise(MADV_COLD, then MADV_PAGEOUT) over each span: reclaim its pages now. Returns 0 or the "
     "errno of the first refusal.");
  m.def("private_page_bytes", [](const SpanArray& s) {
    int64_t total = 0;
    {
      py::gil_scoped_release nogil;
      for (size_t i = 0; i < s.size(); ++i) {
        const int64_t got = private_page_bytes(s.addr[i], s.nbytes[i]);
        if (got < 0) return got;
        total += got;
      }
    }
    return total;
  }, py::arg("spans"),
     "Bytes of the spans' pages that are this process's own, not the file's (/proc/self/pagemap: present "
     "and not a file page, or swapped): mapped pages written in place since they were mapped. Pages are "
     "counted once per span that touches them. Returns -errno where pagemap cannot be read.");
  m.def("unmap_file_pages", [](const SpanArray& s) {
    int64_t total = 0;
    {
      py::gil_scoped_release nogil;
      for (size_t i = 0; i < s.size(); ++i) {
        const int64_t got = unmap_file_pages(s.addr[i], s.nbytes[i]);
        if (got < 0) return got;
        total += got;
      }
    }
    return total;
  }, py::arg("spans"),
     "madvise(MADV_DONTNEED) over each span's pages that this process maps from a file (anonymous, "
     "written pages are kept; read from /proc/self/pagemap): the next touch maps them again. Returns the "
     "bytes advised, or -errno.");
}
