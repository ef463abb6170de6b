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

  // True when reading it calls torch's C function directly (no Python code
  // of the type's own).
  bool native() const { return kind_ != Kind::none && kind_ != Kind::generic_call && kind_ != Kind::generic_get; }

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
  bool native = false;  // every accessor is a C function of torch's

  TypeAccess() = default;
  TypeAccess(const TypeAccess&) = delete;
  TypeAccess& operator=(const TypeAccess&) = delete;
  ~TypeAccess() { reset(); }
  void reset() {
    for (Accessor* a : {&is_cpu, &nbytes, &data_ptr, &is_contiguous, &shape, &stride, &itemsize}) a->reset();
    native = false;
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
    native = true;
    for (const Slot& s : slots) native = native && s.a->native();
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

  const TypeAccess* find(PyTypeObject* t) const {
    for (const TypeAccess& w : ways)
      if (w.type == t) return &w;
    return nullptr;
  }
  const TypeAccess* get(PyTypeObject* t) {
    if (const TypeAccess* w = find(t)) return w;
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
  out = value == Py_True ? 1 : value == Py_False ? 0 : PyObject_IsTrue(value);
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

// ---------------------------------------------------------------------------
// Reading a list without copying it first.
//
// Python code run while a list is read may mutate it and free the items not
// read yet. Such code runs only through an item's accessors: a subclass that
// overrides data_ptr(), a __torch_function__ (a subclass's, or a mode's), a
// warning hook, a finalizer run by a garbage collection that an exception
// object's allocation started. A torch.Tensor or torch.nn.Parameter (torch's
// C code treats both as exact tensors: it looks for no __torch_function__ on
// them) whose accessors are torch's own C functions, with no torch function
// mode active, runs none of it unless it raises or warns. So a list is read
// in place while its items are such tensors, and the moment an item is not,
// the items from there on are held (a reference each) before anything is
// asked of it: what is extracted is the list as it was when the call began.
// Items read in place are checked against the list's item pointers as they
// were when the call began, and each is held while it is read: Python code
// that runs where none was expected (a hook on a warning, a finalizer) can
// neither free an item under the read nor slip another one in; the call
// raises RuntimeError instead.
// ---------------------------------------------------------------------------

// torch.Tensor, torch.nn.Parameter and torch._C._is_torch_function_mode_enabled,
// looked up once torch is imported (the caller passes torch.Tensor, so it is)
// and kept for the process.
struct TorchRefs {
  PyObject* tensor = nullptr;
  PyObject* parameter = nullptr;
  PyObject* mode_enabled = nullptr;
};

PyObject* module_attr(const char* module, const char* name) {
  PyObject* m_name = PyUnicode_FromString(module);
  PyObject* m = m_name ? PyImport_GetModule(m_name) : nullptr;  // never imports
  Py_XDECREF(m_name);
  PyObject* attr = m ? PyObject_GetAttrString(m, name) : nullptr;
  Py_XDECREF(m);
  return attr;
}

const TorchRefs& torch_refs() {
  static TorchRefs r;
  if (!r.tensor) {
    PyObject* tensor = module_attr("torch", "Tensor");
    PyObject* parameter = module_attr("torch.nn.parameter", "Parameter");
    PyObject* mode = module_attr("torch._C", "_is_torch_function_mode_enabled");
    PyErr_Clear();
    if (tensor && PyType_Check(tensor) && parameter && PyType_Check(parameter) && mode) {
      r.tensor = tensor;
      r.parameter = parameter;
      r.mode_enabled = mode;
    } else {
      Py_XDECREF(tensor);
      Py_XDECREF(parameter);
      Py_XDECREF(mode);
    }
  }
  return r;
}

// The types whose items may be read in place in this call (none when a torch
// function mode is active, or torch is not there to ask).
struct InPlaceTypes {
  PyTypeObject* tensor = nullptr;
  PyTypeObject* parameter = nullptr;
  bool has(PyTypeObject* t) const { return t && (t == tensor || t == parameter); }
};

InPlaceTypes in_place_types() {
  InPlaceTypes out;
  const TorchRefs& r = torch_refs();
  if (!r.tensor) return out;
  PyObject* on = PyObject_CallNoArgs(r.mode_enabled);
  const int modes = on ? PyObject_IsTrue(on) : -1;
  Py_XDECREF(on);
  if (modes != 0) {
    PyErr_Clear();
    return out;
  }
  out.tensor = reinterpret_cast<PyTypeObject*>(r.tensor);
  out.parameter = reinterpret_cast<PyTypeObject*>(r.parameter);
  return out;
}

// The items of the sequence being read (see above). A tuple cannot change and
// holds its items: it is read in place. A list is read in place until pin(),
// checked against a copy of its item pointers taken first (no references:
// 8 bytes an item, one memcpy): an item that is not the one the list held
// when the call began is never read. Any other sequence is copied into a
// tuple first.
class Items {
 public:
  Items() = default;
  Items(const Items&) = delete;
  Items& operator=(const Items&) = delete;
  ~Items() {
    if (pinned_)
      for (size_t k = released_; k < items_.size(); ++k) Py_DECREF(items_[k]);
    Py_XDECREF(tuple_);
  }

  bool take(PyObject* seq) {
#ifndef Py_GIL_DISABLED
    // (Without a GIL another thread may change a list at any time: copied then.)
    if (PyList_Check(seq)) {
      list_ = seq;
      PyObject** first = &PyList_GET_ITEM(seq, 0);
      items_.assign(first, first + PyList_GET_SIZE(seq));
      return true;
    }
#endif
    if (!PyTuple_Check(seq)) {
      tuple_ = PySequence_Tuple(seq);
      if (!tuple_) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
          PyErr_Clear();
          PyErr_Format(PyExc_TypeError, "expected a sequence of tensors, got %s", Py_TYPE(seq)->tp_name);
        }
        return false;
      }
      seq = tuple_;
    }
    tuple_items_ = &PyTuple_GET_ITEM(seq, 0);
    tuple_size_ = PyTuple_GET_SIZE(seq);
    return true;
  }

  Py_ssize_t size() const { return tuple_items_ ? tuple_size_ : static_cast<Py_ssize_t>(items_.size()); }
  bool in_place() const { return list_ && !pinned_; }

  // Item i (borrowed), or nullptr with RuntimeError when a list read in
  // place no longer holds it (Python code ran where none was expected).
  PyObject* get(Py_ssize_t i) const {
    if (tuple_items_) return tuple_items_[i];
    PyObject* o = items_[static_cast<size_t>(i)];
    if (!pinned_ && !still_holds(i, o)) return changed();
    return o;
  }

  // From item i on, hold references to the items (the list as it was when
  // the call began: checked).
  bool pin(Py_ssize_t i) {
    if (!in_place()) return true;
    for (size_t k = static_cast<size_t>(i); k < items_.size(); ++k)
      if (!still_holds(static_cast<Py_ssize_t>(k), items_[k])) {
        changed();
        return false;
      }
    for (size_t k = static_cast<size_t>(i); k < items_.size(); ++k) Py_INCREF(items_[k]);
    released_ = static_cast<size_t>(i);
    pinned_ = true;
    return true;
  }

  // Done with item i (in order): drops the reference pin() took to it.
  void done(Py_ssize_t i) {
    if (pinned_ && static_cast<size_t>(i) == released_) Py_DECREF(items_[released_++]);
  }

 private:
  bool still_holds(Py_ssize_t i, PyObject* o) const {
    return i < PyList_GET_SIZE(list_) && PyList_GET_ITEM(list_, i) == o;
  }
  static PyObject* changed() {
    PyErr_SetString(PyExc_RuntimeError, "the list of tensors changed while it was read");
    return nullptr;
  }

  PyObject* list_ = nullptr;               // borrowed: the caller holds it
  std::vector<PyObject*> items_;           // the list's items when the call began; owned after pin()
  size_t released_ = 0;                    // after pin(): references owned for [released_, size)
  bool pinned_ = false;
  PyObject* const* tuple_items_ = nullptr;  // a tuple's items
  Py_ssize_t tuple_size_ = 0;
  PyObject* tuple_ = nullptr;              // owned copy of another sequence
};

}  // namespace

bool extract_tensor_spans(PyObject* seq, PyObject* tensor_type, bool check_device, SpanArray& out) {
  if (!check_type(tensor_type)) return false;
  PyTypeObject* base = reinterpret_cast<PyTypeObject*>(tensor_type);
  Items items;
  if (!items.take(seq)) return false;
  AccessCache cache;
  // Everything that may run Python code, before the first item is read.
  const InPlaceTypes in_place = items.in_place() ? in_place_types() : InPlaceTypes{};
  for (PyTypeObject* t : {in_place.tensor, in_place.parameter})
    if (t && !cache.get(t)) return false;

  const Py_ssize_t len = items.size();
  out.addr.clear();
  out.nbytes.clear();
  out.addr.reserve(static_cast<size_t>(len));  // no zero fill: every slot is written once
  out.nbytes.reserve(static_cast<size_t>(len));
  std::vector<int64_t> sizes, strides;
  bool ok = true;
  for (Py_ssize_t i = 0; i < len && ok; ++i) {
    PyObject* t = items.get(i);
    if (!t) {
      ok = false;
      break;
    }
    if (!PyObject_TypeCheck(t, base)) {
      PyErr_Format(PyExc_TypeError, "item %zd is %s, not a torch.Tensor", i, Py_TYPE(t)->tp_name);
      ok = false;
      break;
    }
    const TypeAccess* a = cache.find(Py_TYPE(t));
    if (items.in_place() && !(a && a->native && in_place.has(Py_TYPE(t)))) {
      // This item may run Python code: hold the rest of the list as it is now.
      if (!items.pin(i)) {
        ok = false;
        break;
      }
      t = items.get(i);
    }
    if (!a) a = cache.get(Py_TYPE(t));
    uint64_t addr = 0, nbytes = 0;
    Py_INCREF(t);
    ok = a && extent_of(t, *a, check_device, i, sizes, strides, addr, nbytes);
    Py_DECREF(t);
    out.addr.push_back(addr);
    out.nbytes.push_back(nbytes);
    items.done(i);
  }
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
