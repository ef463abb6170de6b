// Batched extraction of (data_ptr, nbytes) from a sequence of torch tensors
// through the Python C API, without linking libtorch: the tensor type is passed
// in from Python and attributes are read by name (vectorcall).
#pragma once

#include <Python.h>

#include <cstdint>
#include <vector>

namespace mapoffload {

// Byte spans (structure of arrays). Non-CPU, meta and empty tensors get
// addr 0 and nbytes 0, which every query treats as "not held".
struct SpanArray {
  std::vector<uint64_t> addr, nbytes;
  size_t size() const { return addr.size(); }
};

// Reads data_ptr() and nbytes of every item of `seq` (and is_cpu when
// check_device is true; see regions.py for when it may be skipped). Tensors
// without storage (sparse, XLA) give (0, 0). Raises TypeError naming the index
// of the first item that is not an instance of tensor_type. Must be called
// with the GIL held. Returns false with a Python error set.
bool extract_tensor_spans(PyObject* seq, PyObject* tensor_type, bool check_device, SpanArray& out);


}  // namespace mapoffload
