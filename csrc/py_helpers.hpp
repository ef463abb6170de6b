// Conversions shared by the binding files (GIL held).
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <string>
#include <vector>

namespace mapoffload {
namespace py = pybind11;

inline
py::list bool_list(const std::vector<uint8_t>& v) {
  py::list out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    PyObject* b = v[i] ? Py_True : Py_False;
    Py_INCREF(b);
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), b);
  }
  return out;
}

template <typename T>
inline py::list int_list(const std::vector<T>& v) {
  py::list out(v.size());
  for (size_t i = 0; i < v.size(); ++i)
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i),
                    PyLong_FromUnsignedLongLong(static_cast<unsigned long long>(v[i])));
  return out;
}

// Accepts a buffer of 8-byte unsigned integers (array('Q'), numpy uint64, ...)
// or any sequence of ints.
inline std::vector<uint64_t> to_u64_vector(const py::object& obj, const char* what) {
  if (PyObject_CheckBuffer(obj.ptr())) {
    py::buffer_info info = py::reinterpret_borrow<py::buffer>(obj).request();
    if (info.ndim != 1 || info.itemsize != 8 ||
        !(info.format == "Q" || info.format == "L" || info.format == "K" ||
          info.format == "<Q" || info.format == "=Q" || info.format == "q" || info.format == "l"))
      throw py::type_error(std::string(what) + ": expected a 1-D buffer of 64-bit integers");
    std::vector<uint64_t> v(static_cast<size_t>(info.shape[0]));
    const char* base = static_cast<const char*>(info.ptr);
    for (size_t i = 0; i < v.size(); ++i)
      std::memcpy(&v[i], base + static_cast<ptrdiff_t>(i) * info.strides[0], 8);
    return v;
  }
  return obj.cast<std::vector<uint64_t>>();
}


void bind_copier(py::module_& m);

}  // namespace mapoffload
