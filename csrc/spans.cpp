#include "spans.hpp"

namespace mapoffload {

namespace {

struct Names {
  PyObject* data_ptr;
  PyObject* nbytes;
  PyObject* is_cpu;
};

const Names& names() {
  // Interned once, kept for the life of the process.
  static Names n{PyUnicode_InternFromString("data_ptr"), PyUnicode_InternFromString("nbytes"),
                 PyUnicode_InternFromString("is_cpu")};
  return n;
}

// New reference to int(obj.<name>) as uint64, or false with an error set.
bool read_u64(PyObject* obj, PyObject* value, uint64_t& out) {
  if (!value) return false;
  out = PyLong_AsUnsignedLongLong(value);
  Py_DECREF(value);
  if (out == static_cast<uint64_t>(-1) && PyErr_Occurred()) return false;
  (void)obj;
  return true;
}

}  // namespace

bool extract_tensor_spans(PyObject* seq, PyObject* tensor_type, SpanArray& out) {
  const Names& n = names();
  PyObject* fast = PySequence_Fast(seq, "expected a sequence of tensors");
  if (!fast) return false;
  const Py_ssize_t len = PySequence_Fast_GET_SIZE(fast);
  PyObject** items = PySequence_Fast_ITEMS(fast);
  out.addr.resize(static_cast<size_t>(len));
  out.nbytes.resize(static_cast<size_t>(len));
  for (Py_ssize_t i = 0; i < len; ++i) {
    PyObject* t = items[i];
    int ok = PyObject_IsInstance(t, tensor_type);
    if (ok < 0) { Py_DECREF(fast); return false; }
    if (!ok) {
      PyErr_Format(PyExc_TypeError, "item %zd is %s, not a torch.Tensor", i, Py_TYPE(t)->tp_name);
      Py_DECREF(fast);
      return false;
    }
    PyObject* cpu = PyObject_GetAttr(t, n.is_cpu);
    if (!cpu) { Py_DECREF(fast); return false; }
    const bool on_cpu = cpu == Py_True;
    Py_DECREF(cpu);
    uint64_t addr = 0, nb = 0;
    if (on_cpu) {
      PyObject* args[1] = {t};
      if (!read_u64(t, PyObject_VectorcallMethod(n.data_ptr, args, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr), addr) ||
          !read_u64(t, PyObject_GetAttr(t, n.nbytes), nb)) {
        Py_DECREF(fast);
        return false;
      }
      if (nb == 0) addr = 0;
    }
    out.addr[static_cast<size_t>(i)] = addr;
    out.nbytes[static_cast<size_t>(i)] = addr ? nb : 0;
  }
  Py_DECREF(fast);
  return true;
}

}  // namespace mapoffload
