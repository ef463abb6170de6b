// Python face of the copy engine (glue, and the one thing the engine cannot
// do without the GIL: holding the caller's Python objects).
//
// A job's keepalive object (its source and destination tensors) is held here,
// by the copier, until the job is finished — every byte at its destination,
// device copies included — so dropping a handle, or every reference the
// caller had, is never a use-after-free. Finished jobs let go of their
// objects at the next call into the copier (submit, collect, close), under
// the GIL; the engine's worker threads never touch a Python object.
#include <errno.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "copier.hpp"
#include "host_pin.hpp"
#include "py_helpers.hpp"

namespace mapoffload {

namespace {

class PyCopier {
 public:
  explicit PyCopier(const CopierConfig& c) : core_(new Copier(c)) {}
  ~PyCopier() {
    // Python is tearing the object down (GIL held): stop the engine, wait for
    // device copies, then let go of the objects they read and wrote.
    try {
      shutdown(true);
    } catch (...) {
    }
  }

  std::shared_ptr<CopyJob> submit(const std::vector<CopySpan>& spans, uint64_t stream,
                                  std::optional<uint64_t> wait_for, py::object keepalive) {
    collect();
    std::shared_ptr<CopyJob> job;
    {
      py::gil_scoped_release nogil;
      job = core_->submit(spans, stream, wait_for);
    }
    if (!keepalive.is_none()) held_.emplace_back(job, std::move(keepalive));
    return job;
  }

  // Drops the objects of finished jobs; returns how many jobs still hold some.
  size_t collect() {
    std::vector<py::object> drop;  // released after the list is consistent
    size_t w = 0;
    for (size_t i = 0; i < held_.size(); ++i) {
      if (held_[i].first->done()) drop.push_back(std::move(held_[i].second));
      else held_[w++] = std::move(held_[i]);
    }
    held_.resize(w);
    return held_.size();
  }

  void shutdown(bool cancel) {
    std::vector<std::shared_ptr<CopyJob>> jobs;
    for (auto& h : held_) jobs.push_back(h.first);
    {
      py::gil_scoped_release nogil;
      core_->close(cancel);
      for (auto& j : jobs) j->wait_quietly();  // device copies still reading or writing the objects
    }
    collect();
  }

  Copier& core() { return *core_; }
  size_t holding() const { return held_.size(); }

 private:
  std::unique_ptr<Copier> core_;
  std::vector<std::pair<std::shared_ptr<CopyJob>, py::object>> held_;
};

// Waits for the job's host side in slices, giving Python's signal handlers
// (Ctrl-C) a chance between them: a long copy stays interruptible.
void wait_interruptibly(CopyJob& j) {
  for (;;) {
    bool ready;
    {
      py::gil_scoped_release nogil;
      ready = j.wait_enqueued_for(std::chrono::milliseconds(50));
    }
    if (ready) return;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}

std::vector<CopySpan> make_copy_spans(const py::object& dst, const py::object& src, const py::object& sizes,
                                      const py::object& unstaged) {
  std::vector<uint64_t> d = to_u64_vector(dst, "dst"), s = to_u64_vector(src, "src"), n = to_u64_vector(sizes, "sizes");
  if (d.size() != s.size() || d.size() != n.size())
    throw py::value_error("dst, src and sizes differ in length: " + std::to_string(d.size()) + ", " +
                          std::to_string(s.size()) + ", " + std::to_string(n.size()));
  std::vector<bool> dir;
  if (!unstaged.is_none()) {
    dir = unstaged.cast<std::vector<bool>>();
    if (dir.size() != d.size())
      throw py::value_error("unstaged has " + std::to_string(dir.size()) + " flags for " + std::to_string(d.size()) +
                            " spans");
  }
  std::vector<CopySpan> out(d.size());
  for (size_t i = 0; i < d.size(); ++i) out[i] = {d[i], s[i], n[i], !dir.empty() && dir[i]};
  return out;
}

// A registration and the object owning its memory: unregistered first, then
// the owner let go, so the memory is never freed while it is still locked.
struct PyHostPin {
  std::unique_ptr<HostPin> pin;
  py::object owner;
  ~PyHostPin() {
    py::gil_scoped_release nogil;  // cudaHostUnregister may wait for the device
    pin.reset();
  }
};

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
      // OSError(errno, strerror, filename): .filename names the mapped file.
      py::object filename = e.path().empty() ? py::none() : py::object(py::str(e.path()));
      py::tuple args = py::make_tuple(EIO, e.what(), filename);
      PyErr_SetObject(mapping_fault.ptr(), args.ptr());
    }
  });

  // The copier's limits, one definition (copier.hpp) for C++ and Python.
  m.attr("COPIER_MAX_THREADS") = kMaxThreads;
  m.attr("COPIER_MAX_SLOTS") = kMaxSlots;
  m.attr("COPIER_MAX_SLOT_BYTES") = kMaxSlotBytes;
  m.attr("COPIER_MIN_SLOT_BYTES") = kMinSlotBytes;

  m.def("cuda_available", &cuda_available, "True when libcudart loads and reports a device.");
  m.def("cuda_runtime_library", [] { return cuda_api().library; },
        "The libcudart that was opened (raises CudaError when none can be).");

  m.def("host_register", [](uint64_t ptr, uint64_t nbytes, int device) {
         if (!ptr || !nbytes) throw py::value_error("host_register: null address or zero bytes");
         py::gil_scoped_release nogil;
         host_register(reinterpret_cast<void*>(ptr), static_cast<size_t>(nbytes), device);
       },
       py::arg("ptr"), py::arg("nbytes"), py::kw_only(), py::arg("device") = -1,
       "Page-lock host memory with the CUDA runtime (cudaHostRegister, portable; `device` made current "
       "first when >= 0). Raises CudaError.");
  m.def("host_unregister", [](uint64_t ptr) {
         py::gil_scoped_release nogil;
         host_unregister(reinterpret_cast<void*>(ptr));
       },
       py::arg("ptr"), "cudaHostUnregister(ptr). Raises CudaError.");

  py::class_<PyHostPin>(m, "HostPin",
                        "Host memory page-locked with the CUDA runtime for as long as this object lives "
                        "(cudaHostRegister, then cudaHostUnregister once: unregister() or collection). "
                        "`owner` (the tensor whose memory it is) is held until then. In a forked child it "
                        "unregisters nothing: page locks are not inherited.")
      .def(py::init([](uint64_t ptr, uint64_t nbytes, int device, py::object owner) {
             if (!ptr || !nbytes) throw py::value_error("HostPin: null address or zero bytes");
             auto p = std::make_unique<PyHostPin>();
             {
               py::gil_scoped_release nogil;
               p->pin = std::make_unique<HostPin>(ptr, nbytes, device);
             }
             p->owner = std::move(owner);
             return p;
           }),
           py::arg("ptr"), py::arg("nbytes"), py::kw_only(), py::arg("device") = -1, py::arg("owner") = py::none())
      .def("unregister", [](PyHostPin& p) {
             {
               py::gil_scoped_release nogil;
               p.pin->unregister();
             }
           },
           "Unregister now (idempotent; a no-op in a forked child). Raises CudaError when the runtime refuses.")
      .def_property_readonly("registered", [](const PyHostPin& p) { return p.pin->registered(); })
      .def_property_readonly("ptr", [](const PyHostPin& p) { return p.pin->ptr(); })
      .def_property_readonly("nbytes", [](const PyHostPin& p) { return p.pin->nbytes(); });

  py::class_<CopyJob, std::shared_ptr<CopyJob>>(m, "CopyJob")
      .def("wait", [](CopyJob& j) {
             wait_interruptibly(j);
             py::gil_scoped_release nogil;
             j.wait();
           },
           "Block until finished: every byte at its destination (CUDA: the device copies completed). "
           "Re-raises a worker's error. Ctrl-C interrupts the wait (the copy goes on; the copier keeps "
           "its tensors alive).")
      .def("done", &CopyJob::done, py::call_guard<py::gil_scoped_release>(),
           "Finished (non-blocking; never raises).")
      .def("enqueued", &CopyJob::enqueued, "Every copy has been handed to the stream (CPU: done).")
      .def_property_readonly("device", &CopyJob::device, "The CUDA ordinal copied to, -1 for CPU destinations.")
      .def("wait_stream", [](CopyJob& j, uint64_t stream) {
             wait_interruptibly(j);
             py::gil_scoped_release nogil;
             j.wait_stream(stream);
           },
           py::arg("stream"),
           "Block until enqueued, re-raise the job's error, then make `stream` wait for the copies on the device.");

  py::class_<CopyStats>(m, "CopyStats")
      .def_readonly("jobs", &CopyStats::jobs)
      .def_readonly("units", &CopyStats::units)
      .def_readonly("bytes", &CopyStats::bytes)
      .def_readonly("faults", &CopyStats::faults)
      .def_readonly("read_ns", &CopyStats::read_ns)
      .def_readonly("submit_ns", &CopyStats::submit_ns)
      .def_readonly("slot_wait_ns", &CopyStats::slot_wait_ns)
      .def_readonly("unstaged_bytes", &CopyStats::unstaged_bytes);

  py::class_<PyCopier>(m, "Copier")
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
             return new PyCopier(c);
           }),
           py::arg("device"), py::arg("mode"), py::arg("threads"), py::arg("slot_bytes"), py::arg("slots"),
           py::arg("readahead_units") = 0)
      .def("submit", [](PyCopier& c, const py::object& dst, const py::object& src, const py::object& sizes,
                        uint64_t stream, py::object keepalive, const py::object& unstaged,
                        std::optional<uint64_t> wait_for) {
             return c.submit(make_copy_spans(dst, src, sizes, unstaged), stream, wait_for, std::move(keepalive));
           },
           py::arg("dst"), py::arg("src"), py::arg("sizes"), py::arg("stream") = 0, py::kw_only(),
           py::arg("keepalive") = py::none(), py::arg("unstaged") = py::none(), py::arg("wait_for") = py::none(),
           "Queue (dst, src, nbytes) spans; keepalive is held until the job is finished. wait_for: a stream "
           "(0 included: the legacy default stream) whose queued work goes first; None: none.")
      .def("advise", [](PyCopier& c, const py::object& src, const py::object& sizes) {
             std::vector<uint64_t> s = to_u64_vector(src, "src"), n = to_u64_vector(sizes, "sizes");
             if (s.size() != n.size()) throw py::value_error("src and sizes differ in length");
             std::vector<CopySpan> spans(s.size());
             for (size_t i = 0; i < s.size(); ++i) spans[i] = {0, s[i], n[i]};
             py::gil_scoped_release nogil;
             c.core().advise(spans);
           },
           py::arg("src"), py::arg("sizes"))
      .def("collect", &PyCopier::collect, "Let go of finished jobs' objects; returns how many jobs still hold some.")
      .def_property_readonly("holding", &PyCopier::holding)
      .def("close", &PyCopier::shutdown, py::arg("cancel") = false,
           "Stop the workers (cancel: fail queued copies), wait for device copies, let go of every object.")
      .def_property_readonly("closed", [](PyCopier& c) { return c.core().closed(); })
      .def_property_readonly("broken", [](PyCopier& c) -> py::object {
        std::string b = c.core().broken();
        return b.empty() ? py::none() : py::object(py::str(b));
      })
      .def("stats", [](PyCopier& c) { return c.core().stats(); })
      .def_property_readonly("device", [](PyCopier& c) { return c.core().config().device; })
      .def_property_readonly("mode", [](PyCopier& c) {
        return c.core().config().mode == CopyMode::staged ? "staged" : "direct";
      })
      .def_property_readonly("threads", [](PyCopier& c) { return c.core().config().threads; })
      .def_property_readonly("slot_bytes", [](PyCopier& c) { return c.core().config().slot_bytes; })
      .def_property_readonly("slots", [](PyCopier& c) { return c.core().config().slots; });
}

}  // namespace mapoffload
