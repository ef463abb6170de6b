// Batched extraction of tensors' byte extents through the Python C API,
// without linking libtorch: the tensor type is passed in from Python and
// attributes are read by name (vectorcall).
//
// The extent is the one definition of "a tensor's bytes" in mapoffload: the
// byte range its strides can reach from data_ptr(). Classification, residency
// and the copy-on-write report all read it from here.
#pragma once

#include <Python.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace mapoffload {

// Byte spans (structure of arrays). Non-CPU, meta and empty tensors get
// addr 0 and nbytes 0, which every query treats as "not held".
struct SpanArray {
  std::vector<uint64_t> addr, nbytes;
  size_t size() const { return addr.size(); }
};

// Bytes a strided layout can reach from its first element:
//   numel == 0 -> 0, else (1 + sum_i (size_i - 1) * stride_i) * itemsize.
// A column view spans its rows; a stride-0 dimension spans one element.
// Returns false when a size or stride is negative or the result does not fit
// in 64 bits.
bool strided_extent_bytes(const int64_t* sizes, const int64_t* strides, size_t ndim, uint64_t itemsize,
                          uint64_t& nbytes);

// (data_ptr(), extent) of every item of `seq`, as the sequence was when the
// call began: a tuple is read in place; a list is read in place while its
// items are torch.Tensors or torch.nn.Parameters read through torch's C
// accessors (no Python code runs), and the rest of it is held (a reference
// per item) from the first item that could run Python code (spans.cpp says
// which); any other sequence is copied into a tuple. An item whose methods
// mutate the list cannot free the items not read yet. torch's accessors are
// called through the C functions behind their descriptors, resolved once per
// type. is_cpu is read only when check_device is true (see regions.py for
// when it may be skipped); a tensor is asked is_contiguous() and, only when
// it is not, its shape, stride() and itemsize. Tensors without storage
// (sparse, XLA) and tensors whose data_ptr() is 0 give (0, 0). Raises
// TypeError naming the index of the first item that is not an instance of
// tensor_type, ValueError/OverflowError for a layout without a 64-bit extent,
// RuntimeError if a list read in place changed anyway (Python code run by a
// warning's hook or a finalizer). Must be called with the GIL held. Returns
// false with a Python error set.
bool extract_tensor_spans(PyObject* seq, PyObject* tensor_type, bool check_device, SpanArray& out);

// The same for one tensor.
bool extract_tensor_extent(PyObject* tensor, PyObject* tensor_type, bool check_device, uint64_t& addr,
                           uint64_t& nbytes);

}  // namespace mapoffload
