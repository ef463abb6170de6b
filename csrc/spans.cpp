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

// How one attribute is read for an object of a given type.
//
// torch's accessors are CPython method descriptors (data_ptr, is_contiguous,
// stride) and getset descriptors (is_cpu, nbytes, shape, itemsize). For those
// we keep the C function behind the descriptor and call it directly: that is
// what CPython's own vectorcall of the descriptor does after its argument and
// type checks, which resolve() does once per type (the descriptor was found on
// the type's MRO and the type is a subtype of the descriptor's class). Saves
// ~10-20 ns a call next to torch's ~30-60 ns getters, on every tensor.
// Anything else -- a Python override in a subclass, a property, a method
// descriptor of an unusual calling convention -- goes through the generic
// protocol (vectorcall of the type's attribute, or its tp_descr_get), exactly
// as `t.data_ptr()` / `t.nbytes` would.
class Accessor {
 public:
  Accessor() = default;
  Accessor(const Accessor&) = delete;
  Accessor& operator=(const Accessor&) = delete;
  ~Accessor() { reset(); }

  void reset() {
    Py_CLEAR(attr_);
    kind_ = Kind::none;
    fn_ = nullptr;
    getter_ = nullptr;
    closure_ = nullptr;
  }

  // `attr` (a new reference, stolen) is the attribute as looked up on `type`;
  // `method` says whether it is called (t.name()) or read (t.name).
  void bind(PyObject* attr, PyTypeObject* type, bool method) {
    reset();
    attr_ = attr;
    kind_ = method ? Kind::generic_call : Kind::generic_get;
    if (method && Py_TYPE(attr) == &PyMethodDescr_Type) {
      auto* d = reinterpret_cast<PyMethodDescrObject*>(attr);
      if (!PyType_IsSubtype(type, PyDescr_TYPE(d))) return;
      const int flags = d->d_method->ml_flags;
      if (flags & (METH_CLASS | METH_STATIC | METH_METHOD)) return;
      fn_ = reinterpret_cast<void*>(d->d_method->ml_meth);
      switch (flags & (METH_VARARGS | METH_FASTCALL | METH_NOARGS | METH_O | METH_KEYWORDS)) {
        case METH_NOARGS: kind_ = Kind::noargs; break;
        case METH_VARARGS: kind_ = Kind::varargs; break;
        case METH_VARARGS | METH_KEYWORDS: kind_ = Kind::varargs_kw; break;
        case METH_FASTCALL: kind_ = Kind::fastcall; break;
        case METH_FASTCALL | METH_KEYWORDS: kind_ = Kind::fastcall_kw; break;
        default: fn_ = nullptr; break;  // METH_O needs an argument: not an accessor
      }
    } else if (!method && Py_TYPE(attr) == &PyGetSetDescr_Type) {
      auto* d = reinterpret_cast<PyGetSetDescrObject*>(attr);
      if (d->d_getset->get && PyType_IsSubtype(type, PyDescr_TYPE(d))) {
        kind_ = Kind::getset;
        getter_ = d->d_getset->get;
        closure_ = d->d_getset->closure;
      }
    }
  }

  // New reference to t.name() or t.name; nullptr with an error set.
  PyObject* operator()(PyObject* obj) const {
    switch (kind_) {
      case Kind::getset: return checked(getter_(obj, closure_));
      case Kind::noargs: return checked(reinterpret_cast<PyCFunction>(fn_)(obj, nullptr));
      case Kind::varargs: return checked(reinterpret_cast<PyCFunction>(fn_)(obj, empty_tuple()));
      case Kind::varargs_kw:
        return checked(reinterpret_cast<PyCFunctionWithKeywords>(fn_)(obj, empty_tuple(), nullptr));
      case Kind::fastcall: return checked(reinterpret_cast<FastFn>(fn_)(obj, nullptr, 0));
      case Kind::fastcall_kw: return checked(reinterpret_cast<FastKwFn>(fn_)(obj, nullptr, 0, nullptr));
      case Kind::generic_call: {
        PyObject* args[1] = {obj};
        return PyObject_Vectorcall(attr_, args, 1, nullptr);
      }
      case Kind::generic_get: {
        descrgetfunc f = Py_TYPE(attr_)->tp_descr_get;
        if (!f) {
          Py_INCREF(attr_);
          return attr_;
        }
        return f(attr_, obj, reinterpret_cast<PyObject*>(Py_TYPE(obj)));
      }
      case Kind::none: break;
    }
    PyErr_SetString(PyExc_SystemError, "mapoffload: accessor used before it was bound");
    return nullptr;
  }

 private:
  // METH_FASTCALL signatures (CPython names them differently across versions).
  using FastFn = PyObject* (*)(PyObject*, PyObject* const*, Py_ssize_t);
  using FastKwFn = PyObject* (*)(PyObject*, PyObject* const*, Py_ssize_t, PyObject*);
  enum class Kind : uint8_t { none, generic_call, generic_get, getset, noargs, varargs, varargs_kw, fastcall,
                              fastcall_kw };

  static PyObject* empty_tuple() {
    static PyObject* t = PyTuple_New(0);  // immortal in practice: kept for the process
    return t;
  }
  // Half of what vectorcall's result check does: NULL without an error set
  // becomes a SystemError. (A value returned with an error set is not looked
  // for: a PyErr_Occurred() per call costs more than torch's getters gain.)
  static PyObject* checked(PyObject* r) {
    if (!r && !PyErr_Occurred())
      PyErr_SetString(PyExc_SystemError, "a tensor accessor returned NULL without setting an error");
    return r;
  }

  PyObject* attr_ = nullptr;  // owned: keeps fn_/getter_ alive
  Kind kind_ = Kind::none;
  void* fn_ = nullptr;
  getter getter_ = nullptr;
  void* closure_ = nullptr;
};

// The attributes read from each tensor, resolved once per Python type.
//
// Looking an attribute up on an instance walks the MRO and the instance's
// __dict__ on every call; the attributes we need are descriptors on the type,
// so resolving them once per type and invoking them directly gives the same
// answer as `t.is_cpu`, `t.data_ptr()`, ... at a fraction of the cost.
// Instances that shadow these names in their own __dict__ are not supported
// (torch never does).
struct TypeAccess {
  PyTypeObject* type = nullptr;  // owned
  Accessor is_cpu, nbytes, data_ptr, is_contiguous, shape, stride, itemsize;

  TypeAccess() = default;
  TypeAccess(const TypeAccess&) = delete;
  TypeAccess& operator=(const TypeAccess&) = delete;
  ~TypeAccess() { reset(); }
  void reset() {
    for (Accessor* a : {&is_cpu, &nbytes, &data_ptr, &is_contiguous, &shape, &stride, &itemsize}) a->reset();
    PyObject* t = reinterpret_cast<PyObject*>(type);
    type = nullptr;
    Py_XDECREF(t);
  }
  bool resolve(PyTypeObject* t) {
    reset();
    const Names& n = names();
    PyObject* tp = reinterpret_cast<PyObject*>(t);
    struct Slot {
      Accessor* a;
      PyObject* key;
      bool method;
    } slots[] = {{&is_cpu, n.is_cpu, false},          {&nbytes, n.nbytes, false},
                 {&data_ptr, n.data_ptr, true},       {&is_contiguous, n.is_contiguous, true},
                 {&shape, n.shape, false},            {&stride, n.stride, true},
                 {&itemsize, n.itemsize, false}};
    for (const Slot& s : slots) {
      PyObject* attr = PyObject_GetAttr(tp, s.key);
      if (!attr) {
        reset();
        return false;
      }
      s.a->bind(attr, t, s.method);
    }
    Py_INCREF(tp);
    type = t;
    return true;
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
  if (PyLong_Check(value)) {
    // Addresses and byte counts fit 63 bits: PyLong_AsLongLongAndOverflow
    // reads the digits directly, where PyLong_AsUnsignedLongLong goes through
    // _PyLong_AsByteArray for every value above 2**30 (each data_ptr()).
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow == 0 && v >= 0) {
      out = static_cast<uint64_t>(v);
      Py_DECREF(value);
      return true;
    }
  }
  // Negative, beyond 63 bits, or not an int: the exact conversion and its error.
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
    if (!take_bool(a.is_cpu(t), on_cpu)) return false;
    if (!on_cpu) return true;
  }
  if (!take_u64(a.data_ptr(t), addr)) {
    addr = 0;
    return clear_no_storage_error();
  }
  if (addr == 0) return true;  // meta tensors, empty storages
  int contiguous;
  if (!take_bool(a.is_contiguous(t), contiguous)) return false;
  if (contiguous) {
    // numel * itemsize: the extent of a dense layout, in one attribute read.
    if (!take_u64(a.nbytes(t), nbytes)) return false;
  } else {
    uint64_t itemsize;
    if (!take_int64s(a.shape(t), sizes, index, "shape") ||
        !take_int64s(a.stride(t), strides, index, "stride()") || !take_u64(a.itemsize(t), itemsize))
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
  out.addr.clear();
  out.nbytes.clear();
  out.addr.reserve(static_cast<size_t>(len));  // no zero fill: every slot is written once
  out.nbytes.reserve(static_cast<size_t>(len));
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
    uint64_t addr = 0, nbytes = 0;
    ok = a && extent_of(t, *a, check_device, i, sizes, strides, addr, nbytes);
    out.addr.push_back(addr);
    out.nbytes.push_back(nbytes);
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
