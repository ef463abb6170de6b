// The CUDA runtime, loaded with dlopen at first use.
//
// Building needs no CUDA toolkit and the extension never links libcudart or
// libtorch: the few runtime entry points the copier needs are declared here
// with their C ABI and resolved from the libcudart that torch already loaded
// (RTLD_NOLOAD), else from the first soname that opens.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

namespace mapoffload {

// Opaque CUDA runtime types, as the C ABI passes them.
using cudaError_t = int;
using cudaStream_t = void*;
using cudaEvent_t = void*;

constexpr cudaError_t kCudaSuccess = 0;
constexpr int kCudaMemcpyHostToDevice = 1;
constexpr unsigned kCudaHostAllocPortable = 1;
constexpr unsigned kCudaEventDisableTiming = 2;
constexpr unsigned kCudaHostRegisterPortable = 1;

// A failed CUDA runtime call: the call, the CUDA error string, file and line.
class CudaError : public std::runtime_error {
 public:
  CudaError(const std::string& call, int code, const std::string& what, const char* file, int line);
  int code() const { return code_; }

 private:
  int code_;
};

struct CudaApi {
  cudaError_t (*GetDeviceCount)(int*);
  cudaError_t (*SetDevice)(int);
  cudaError_t (*GetDevice)(int*);
  cudaError_t (*HostAlloc)(void**, size_t, unsigned);
  cudaError_t (*FreeHost)(void*);
  cudaError_t (*HostRegister)(void*, size_t, unsigned);
  cudaError_t (*HostUnregister)(void*);
  cudaError_t (*MemcpyAsync)(void*, const void*, size_t, int, cudaStream_t);
  cudaError_t (*EventCreateWithFlags)(cudaEvent_t*, unsigned);
  cudaError_t (*EventRecord)(cudaEvent_t, cudaStream_t);
  cudaError_t (*EventSynchronize)(cudaEvent_t);
  cudaError_t (*EventQuery)(cudaEvent_t);
  cudaError_t (*EventDestroy)(cudaEvent_t);
  cudaError_t (*StreamWaitEvent)(cudaStream_t, cudaEvent_t, unsigned);
  cudaError_t (*StreamSynchronize)(cudaStream_t);
  cudaError_t (*GetLastError)();
  const char* (*GetErrorString)(cudaError_t);
  std::string library;  // the soname or path that was opened
};

// The runtime table; throws CudaError (call "dlopen"/"dlsym") when it cannot
// be loaded. Thread-safe; loaded once.
const CudaApi& cuda_api();

// True when the runtime loads and reports at least one device.
bool cuda_available();

void check_cuda(cudaError_t err, const char* call, const char* file, int line);

// Makes device `dev` current for a scope and restores the caller's (torch
// tracks the current device per thread). dev < 0: leaves it as it is.
struct DeviceScope {
  int prev = -1;
  explicit DeviceScope(int dev);
  ~DeviceScope();
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
};

}  // namespace mapoffload

#define MAPOFFLOAD_CUDA_CHECK(call_expr) \
  ::mapoffload::check_cuda((call_expr), #call_expr, __FILE__, __LINE__)
