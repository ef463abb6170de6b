// PYBIND11_MODULE(_core): glue only. Inputs are converted under the GIL; the
// batched work runs with the GIL released.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>

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
    return with_mounts(parse_maps(read_text_file(maps)), mounts);
  }, py::arg("maps_path") = "/proc/self/maps", py::arg("mountinfo_path") = "/proc/self/mountinfo",
     "Read and index one maps snapshot. Raises OSError when maps_path is unreadable.");
  m.def("read_smaps", [](const py::object& smaps_path, const py::object& mountinfo_path) {
    std::string smaps = fs_path(smaps_path), mounts = fs_path(mountinfo_path);
    py::gil_scoped_release nogil;
    return with_mounts(parse_smaps(read_text_file(smaps)), mounts);
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
  m.def("advise_random", [](const SpanArray& s, bool on) {
    py::gil_scoped_release nogil;
    int first = 0;
    for (size_t i = 0; i < s.size(); ++i) {
      int err = advise_random(s.addr[i], s.nbytes[i], on);
      if (first == 0) first = err;
    }
    return first;
  }, py::arg("spans"), py::arg("on") = true,
     "madvise(MADV_RANDOM) (on) or MADV_NORMAL (off) over each span: faults read their own page only, "
     "no read-around. Returns 0 or the errno of the first refusal.");
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
}
