#include "spans.hpp"

namespace mapoffload {

bool strided_extent_bytes(const int64_t* sizes, const int64_t* strides, size_t ndim, uint64_t itemsize,
                          uint64_t& nbytes) {
  uint64_t last = 0;  // offset, in elements, of the last element reachable
  for (size_t i = 0; i < ndim; ++i) {
    if (sizes[i] < 0 || strides[i] < 0) return false;
    if (sizes[i] == 0) {
      nbytes = 0;
      return true;
    }
  }
  for (size_t i = 0; i < ndim; ++i) {
    uint64_t step;
    if (__builtin_mul_overflow(static_cast<uint64_t>(sizes[i] - 1), static_cast<uint64_t>(strides[i]), &step) ||
        __builtin_add_overflow(last, step, &last))
      return false;
  }
  return !__builtin_add_overflow(last, uint64_t{1}, &last) && !__builtin_mul_overflow(last, itemsize, &nbytes);
}

namespace {

struct Names {
  PyObject* data_ptr;
  PyObject* nbytes;
  PyObject* is_cpu;
  PyObject* is_contiguous;
  PyObject* shape;
  PyObject* stride;
  PyObject* itemsize;
};

const Names& names() {
  // Interned once, kept for the life of the process.
  static Names n{PyUnicode_InternFromString("data_ptr"),      PyUnicode_InternFromString("nbytes"),
                 PyUnicode_InternFromString("is_cpu"),        PyUnicode_InternFromString("is_contiguous"),
                 PyUnicode_InternFromString("shape"),         PyUnicode_InternFromString("stride"),
                 PyUnicode_InternFromString("itemsize")};
  return n;
}

// The attributes read from each tensor, resolved once per Python type.
//
// Looking an attribute up on an instance walks the MRO and the instance's
// __dict__ on every call; the attributes we need are descriptors on the type
// (getset descriptors for is_cpu/nbytes/shape/itemsize, methods for data_ptr,
// is_contiguous and stride), so resolving them once per type and invoking the
// descriptor directly gives the same answer as `t.is_cpu`, `t.data_ptr()`, ...
// at a fraction of the cost. Instances that shadow these names in their own
// __dict__ are not supported (torch never does).
struct TypeAccess {
  PyTypeObject* type = nullptr;  // owned
  PyObject* is_cpu = nullptr;    // descriptors and unbound methods, owned
  PyObject* nbytes = nullptr;
  PyObject* data_ptr = nullptr;
  PyObject* is_contiguous = nullptr;
  PyObject* shape = nullptr;
  PyObject* stride = nullptr;
  PyObject* itemsize = nullptr;

  TypeAccess() = default;
  TypeAccess(const TypeAccess&) = delete;
  TypeAccess& operator=(const TypeAccess&) = delete;
  ~TypeAccess() { reset(); }
  void reset() {
    Py_CLEAR(is_cpu);
    Py_CLEAR(nbytes);
    Py_CLEAR(data_ptr);
    Py_CLEAR(is_contiguous);
    Py_CLEAR(shape);
    Py_CLEAR(stride);
    Py_CLEAR(itemsize);
    PyObject* t = reinterpret_cast<PyObject*>(type);
    type = nullptr;
    Py_XDECREF(t);
  }
  bool resolve(PyTypeObject* t) {
    reset();
    const Names& n = names();
    PyObject* tp = reinterpret_cast<PyObject*>(t);
    PyObject** slots[] = {&is_cpu, &nbytes, &data_ptr, &is_contiguous, &shape, &stride, &itemsize};
    PyObject* keys[] = {n.is_cpu, n.nbytes, n.data_ptr, n.is_contiguous, n.shape, n.stride, n.itemsize};
    for (size_t k = 0; k < sizeof keys / sizeof keys[0]; ++k) {
      *slots[k] = PyObject_GetAttr(tp, keys[k]);
      if (!*slots[k]) {
        reset();
        return false;
      }
    }
    Py_INCREF(tp);
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
  PyObject* call(PyObject* method, PyObject* obj) const {
    PyObject* args[1] = {obj};
    return PyObject_Vectorcall(method, args, 1, nullptr);
  }
};

// A few types at once: a model's list mixes Parameter and Tensor.
struct AccessCache {
  static constexpr size_t kWays = 4;
  TypeAccess ways[kWays];
  size_t next = 0;

  const TypeAccess* get(PyTypeObject* t) {
    for (const TypeAccess& w : ways)
      if (w.type == t) return &w;
    TypeAccess& w = ways[next];
    next = (next + 1) % kWays;
    return w.resolve(t) ? &w : nullptr;
  }
};

bool take_u64(PyObject* value, uint64_t& out) {
  if (!value) return false;
  out = PyLong_AsUnsignedLongLong(value);
  Py_DECREF(value);
  return !(out == static_cast<uint64_t>(-1) && PyErr_Occurred());
}

bool take_bool(PyObject* value, int& out) {
  if (!value) return false;
  out = PyObject_IsTrue(value);
  Py_DECREF(value);
  return out >= 0;
}

// True when the error set is one torch raises for tensors without storage
// (sparse, XLA, functional wrappers): such a tensor has no host bytes.
bool clear_no_storage_error() {
  if (!PyErr_ExceptionMatches(PyExc_RuntimeError)) return false;
  PyErr_Clear();
  return true;
}

// Reads a tuple of ints (torch.Size or stride()) into v. Steals `tuple`.
bool take_int64s(PyObject* tuple, std::vector<int64_t>& v, Py_ssize_t index, const char* what) {
  if (!tuple) return false;
  if (!PyTuple_Check(tuple)) {
    PyErr_Format(PyExc_TypeError, "item %zd: %s is %s, not a tuple", index, what, Py_TYPE(tuple)->tp_name);
    Py_DECREF(tuple);
    return false;
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(tuple);
  v.resize(static_cast<size_t>(n));
  for (Py_ssize_t k = 0; k < n; ++k) {
    long long x = PyLong_AsLongLong(PyTuple_GET_ITEM(tuple, k));
    if (x == -1 && PyErr_Occurred()) {
      Py_DECREF(tuple);
      return false;
    }
    v[static_cast<size_t>(k)] = x;
  }
  Py_DECREF(tuple);
  return true;
}

// Extent of one tensor whose type has been checked. `index` names it in errors.
bool extent_of(PyObject* t, const TypeAccess& a, bool check_device, Py_ssize_t index, std::vector<int64_t>& sizes,
               std::vector<int64_t>& strides, uint64_t& addr, uint64_t& nbytes) {
  addr = 0;
  nbytes = 0;
  if (check_device) {
    int on_cpu;
    if (!take_bool(a.get(a.is_cpu, t), on_cpu)) return false;
    if (!on_cpu) return true;
  }
  if (!take_u64(a.call(a.data_ptr, t), addr)) {
    addr = 0;
    return clear_no_storage_error();
  }
  if (addr == 0) return true;  // meta tensors, empty storages
  int contiguous;
  if (!take_bool(a.call(a.is_contiguous, t), contiguous)) return false;
  if (contiguous) {
    // numel * itemsize: the extent of a dense layout, in one attribute read.
    if (!take_u64(a.get(a.nbytes, t), nbytes)) return false;
  } else {
    uint64_t itemsize;
    if (!take_int64s(a.get(a.shape, t), sizes, index, "shape") ||
        !take_int64s(a.call(a.stride, t), strides, index, "stride()") || !take_u64(a.get(a.itemsize, t), itemsize))
      return false;
    if (sizes.size() != strides.size()) {
      PyErr_Format(PyExc_ValueError, "item %zd: %zu sizes but %zu strides", index, sizes.size(), strides.size());
      return false;
    }
    if (!strided_extent_bytes(sizes.data(), strides.data(), sizes.size(), itemsize, nbytes)) {
      PyErr_Format(PyExc_OverflowError,
                   "item %zd: a negative size or stride, or a byte extent beyond 64 bits", index);
      return false;
    }
  }
  if (nbytes == 0) addr = 0;
  return true;
}

bool check_type(PyObject* tensor_type) {
  if (PyType_Check(tensor_type)) return true;
  PyErr_SetString(PyExc_TypeError, "tensor_type must be a type");
  return false;
}

}  // namespace

bool extract_tensor_spans(PyObject* seq, PyObject* tensor_type, bool check_device, SpanArray& out) {
  if (!check_type(tensor_type)) return false;
  PyTypeObject* base = reinterpret_cast<PyTypeObject*>(tensor_type);
  // A tuple owns its items and cannot change: a list is copied into one (one
  // reference per item), so Python code run by data_ptr() & co. can mutate
  // the caller's list without freeing what the loop reads.
  PyObject* items = PySequence_Tuple(seq);
  if (!items) {
    if (PyErr_ExceptionMatches(PyExc_TypeError)) {
      PyErr_Clear();
      PyErr_Format(PyExc_TypeError, "expected a sequence of tensors, got %s", Py_TYPE(seq)->tp_name);
    }
    return false;
  }
  const Py_ssize_t len = PyTuple_GET_SIZE(items);
  out.addr.resize(static_cast<size_t>(len));
  out.nbytes.resize(static_cast<size_t>(len));
  AccessCache cache;
  std::vector<int64_t> sizes, strides;
  bool ok = true;
  for (Py_ssize_t i = 0; i < len && ok; ++i) {
    PyObject* t = PyTuple_GET_ITEM(items, i);
    if (!PyObject_TypeCheck(t, base)) {
      PyErr_Format(PyExc_TypeError, "item %zd is %s, not a torch.Tensor", i, Py_TYPE(t)->tp_name);
      ok = false;
      break;
    }
    const TypeAccess* a = cache.get(Py_TYPE(t));
    ok = a && extent_of(t, *a, check_device, i, sizes, strides, out.addr[static_cast<size_t>(i)],
                        out.nbytes[static_cast<size_t>(i)]);
  }
  Py_DECREF(items);
  return ok;
}

bool extract_tensor_extent(PyObject* tensor, PyObject* tensor_type, bool check_device, uint64_t& addr,
                           uint64_t& nbytes) {
  if (!check_type(tensor_type)) return false;
  if (!PyObject_TypeCheck(tensor, reinterpret_cast<PyTypeObject*>(tensor_type))) {
    PyErr_Format(PyExc_TypeError, "%s is not a torch.Tensor", Py_TYPE(tensor)->tp_name);
    return false;
  }
  Py_INCREF(tensor);
  TypeAccess a;
  std::vector<int64_t> sizes, strides;
  bool ok = a.resolve(Py_TYPE(tensor)) && extent_of(tensor, a, check_device, 0, sizes, strides, addr, nbytes);
  Py_DECREF(tensor);
  return ok;
}

}  // namespace mapoffload
