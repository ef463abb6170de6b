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

// The three attributes read from each tensor, resolved once per Python type.
//
// Looking an attribute up on an instance walks the MRO and the instance's
// __dict__ on every call; the attributes we need are descriptors on the type
// (getset descriptors for is_cpu/nbytes, a method for data_ptr), so resolving
// them once per type and invoking the descriptor directly gives the same
// answer as `t.is_cpu`, `t.nbytes`, `t.data_ptr()` at a fraction of the cost.
// Instances that shadow these names in their own __dict__ are not supported
// (torch never does).
struct TypeAccess {
  PyTypeObject* type = nullptr;
  PyObject* is_cpu = nullptr;    // descriptor (borrowed from the type's dict chain; owned here)
  PyObject* nbytes = nullptr;
  PyObject* data_ptr = nullptr;  // unbound method

  ~TypeAccess() { reset(); }
  void reset() {
    Py_CLEAR(is_cpu);
    Py_CLEAR(nbytes);
    Py_CLEAR(data_ptr);
    type = nullptr;
  }
  bool resolve(PyTypeObject* t) {
    if (t == type) return true;
    reset();
    const Names& n = names();
    PyObject* tp = reinterpret_cast<PyObject*>(t);
    is_cpu = PyObject_GetAttr(tp, n.is_cpu);
    nbytes = is_cpu ? PyObject_GetAttr(tp, n.nbytes) : nullptr;
    data_ptr = nbytes ? PyObject_GetAttr(tp, n.data_ptr) : nullptr;
    if (!data_ptr) {
      reset();
      return false;
    }
    type = t;
    return true;
  }
  // New reference to the value of a (data or non-data) descriptor for obj.
  PyObject* get(PyObject* descr, PyObject* obj) const {
    descrgetfunc f = Py_TYPE(descr)->tp_descr_get;
    if (!f) {
      Py_INCREF(descr);
      return descr;
    }
    return f(descr, obj, reinterpret_cast<PyObject*>(type));
  }
  PyObject* call_data_ptr(PyObject* obj) const {
    PyObject* args[1] = {obj};
    return PyObject_Vectorcall(data_ptr, args, 1, nullptr);
  }
};

bool take_u64(PyObject* value, uint64_t& out) {
  if (!value) return false;
  out = PyLong_AsUnsignedLongLong(value);
  Py_DECREF(value);
  return !(out == static_cast<uint64_t>(-1) && PyErr_Occurred());
}

}  // namespace

// True when the error set is one torch raises for tensors without storage
// (sparse, XLA, functional wrappers): such a tensor has no host bytes.
bool clear_no_storage_error() {
  if (!PyErr_ExceptionMatches(PyExc_RuntimeError)) return false;
  PyErr_Clear();
  return true;
}

bool extract_tensor_spans(PyObject* seq, PyObject* tensor_type, bool check_device, SpanArray& out) {
  if (!PyType_Check(tensor_type)) {
    PyErr_SetString(PyExc_TypeError, "tensor_type must be a type");
    return false;
  }
  PyTypeObject* base = reinterpret_cast<PyTypeObject*>(tensor_type);
  PyObject* fast = PySequence_Fast(seq, "expected a sequence of tensors");
  if (!fast) return false;
  const Py_ssize_t len = PySequence_Fast_GET_SIZE(fast);
  PyObject** items = PySequence_Fast_ITEMS(fast);
  out.addr.resize(static_cast<size_t>(len));
  out.nbytes.resize(static_cast<size_t>(len));
  TypeAccess access;
  bool ok = true;
  for (Py_ssize_t i = 0; i < len && ok; ++i) {
    PyObject* t = items[i];
    if (!PyObject_TypeCheck(t, base)) {
      PyErr_Format(PyExc_TypeError, "item %zd is %s, not a torch.Tensor", i, Py_TYPE(t)->tp_name);
      ok = false;
      break;
    }
    if (!access.resolve(Py_TYPE(t))) { ok = false; break; }
    int on_cpu = 1;
    if (check_device) {
      PyObject* cpu = access.get(access.is_cpu, t);
      if (!cpu) { ok = false; break; }
      on_cpu = PyObject_IsTrue(cpu);
      Py_DECREF(cpu);
      if (on_cpu < 0) { ok = false; break; }
    }
    uint64_t addr = 0, nb = 0;
    if (on_cpu) {
      if (!take_u64(access.call_data_ptr(t), addr)) {
        if (!clear_no_storage_error()) { ok = false; break; }
        addr = 0;
      } else if (!take_u64(access.get(access.nbytes, t), nb)) {
        ok = false;
        break;
      }
    }
    if (nb == 0) addr = 0;
    if (addr == 0) nb = 0;
    out.addr[static_cast<size_t>(i)] = addr;
    out.nbytes[static_cast<size_t>(i)] = nb;
  }
  Py_DECREF(fast);
  return ok;
}

}  // namespace mapoffload
