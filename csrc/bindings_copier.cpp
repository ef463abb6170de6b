// Python face of the copy engine (glue only).
#include <pybind11/pybind11.h>

#include "copier.hpp"
#include "py_helpers.hpp"

namespace mapoffload {

namespace {

std::vector<CopySpan> make_copy_spans(const py::object& dst, const py::object& src, const py::object& sizes) {
  std::vector<uint64_t> d = to_u64_vector(dst, "dst"), s = to_u64_vector(src, "src"), n = to_u64_vector(sizes, "sizes");
  if (d.size() != s.size() || d.size() != n.size())
    throw py::value_error("dst, src and sizes differ in length: " + std::to_string(d.size()) + ", " +
                          std::to_string(s.size()) + ", " + std::to_string(n.size()));
  std::vector<CopySpan> out(d.size());
  for (size_t i = 0; i < d.size(); ++i) {
    if (n[i] && (d[i] == 0 || s[i] == 0))
      throw py::value_error("span " + std::to_string(i) + " has a null address");
    out[i] = {d[i], s[i], n[i]};
  }
  return out;
}

}  // namespace

void bind_copier(py::module_& m) {
  static py::exception<CudaError> cuda_error(m, "CudaError", PyExc_RuntimeError);
  static py::exception<MappingFault> mapping_fault(m, "MappingFaultError", PyExc_OSError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const CudaError& e) {
      py::set_error(cuda_error, e.what());
    } catch (const MappingFault& e) {
      py::set_error(mapping_fault, e.what());
    }
  });

  m.def("cuda_available", &cuda_available, "True when libcudart loads and reports a device.");
  m.def("cuda_runtime_library", [] { return cuda_api().library; },
        "The libcudart that was opened (raises CudaError when none can be).");

  py::class_<CopyJob, std::shared_ptr<CopyJob>>(m, "CopyJob")
      .def("wait", &CopyJob::wait, py::call_guard<py::gil_scoped_release>(),
           "Block until every span is enqueued (CUDA) or copied (CPU); re-raise a worker's error.")
      .def("done", &CopyJob::done);

  py::class_<CopyStats>(m, "CopyStats")
      .def_readonly("jobs", &CopyStats::jobs)
      .def_readonly("units", &CopyStats::units)
      .def_readonly("bytes", &CopyStats::bytes)
      .def_readonly("faults", &CopyStats::faults)
      .def_readonly("read_ns", &CopyStats::read_ns)
      .def_readonly("submit_ns", &CopyStats::submit_ns)
      .def_readonly("slot_wait_ns", &CopyStats::slot_wait_ns);

  py::class_<Copier>(m, "Copier")
      .def(py::init([](int device, const std::string& mode, size_t threads, size_t slot_bytes, size_t slots,
                       size_t readahead_units) {
             CopierConfig c;
             c.device = device;
             if (mode == "staged") c.mode = CopyMode::staged;
             else if (mode == "direct") c.mode = CopyMode::direct;
             else throw py::value_error("mode must be 'staged' or 'direct', not '" + mode + "'");
             c.threads = threads;
             c.slot_bytes = slot_bytes;
             c.slots = slots;
             c.readahead_units = readahead_units;
             py::gil_scoped_release nogil;
             return new Copier(c);
           }),
           py::arg("device"), py::arg("mode"), py::arg("threads"), py::arg("slot_bytes"), py::arg("slots"),
           py::arg("readahead_units") = 0)
      .def("submit", [](Copier& c, const py::object& dst, const py::object& src, const py::object& sizes,
                        uint64_t stream) {
             std::vector<CopySpan> spans = make_copy_spans(dst, src, sizes);
             py::gil_scoped_release nogil;
             return c.submit(spans, stream);
           },
           py::arg("dst"), py::arg("src"), py::arg("sizes"), py::arg("stream") = 0)
      .def("advise", [](const Copier& c, const py::object& src, const py::object& sizes) {
             std::vector<uint64_t> s = to_u64_vector(src, "src"), n = to_u64_vector(sizes, "sizes");
             if (s.size() != n.size()) throw py::value_error("src and sizes differ in length");
             std::vector<CopySpan> spans(s.size());
             for (size_t i = 0; i < s.size(); ++i) spans[i] = {0, s[i], n[i]};
             py::gil_scoped_release nogil;
             c.advise(spans);
           },
           py::arg("src"), py::arg("sizes"))
      .def("close", &Copier::close, py::arg("cancel") = false, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("closed", &Copier::closed)
      .def("stats", &Copier::stats)
      .def_property_readonly("device", [](const Copier& c) { return c.config().device; })
      .def_property_readonly("mode", [](const Copier& c) {
        return c.config().mode == CopyMode::staged ? "staged" : "direct";
      })
      .def_property_readonly("threads", [](const Copier& c) { return c.config().threads; })
      .def_property_readonly("slot_bytes", [](const Copier& c) { return c.config().slot_bytes; })
      .def_property_readonly("slots", [](const Copier& c) { return c.config().slots; });
}

}  // namespace mapoffload
