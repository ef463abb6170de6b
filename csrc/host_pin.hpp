// Page-locking host memory that the CUDA runtime did not allocate
// (cudaHostRegister), so that a device copy DMAs straight from it.
//
// Used for the buffers a layer is read into uncached: pinned,
// the copies from them need no staging slot (one copy, not two). The runtime
// comes from cuda_api (dlopen): nothing here needs a CUDA toolkit to build.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace mapoffload {

// cudaHostRegister(ptr, nbytes, portable) with `device` current (< 0: the
// calling thread's). Throws CudaError.
void host_register(void* ptr, size_t nbytes, int device = -1);

// cudaHostUnregister(ptr). Throws CudaError.
void host_unregister(void* ptr);

// One registration, undone exactly once: by unregister(), else by the
// destructor. The memory must outlive it (the binding holds its owner).
//
// fork(): a child does not inherit page locks (the kernel pins pages for the
// process that asked) and its CUDA runtime is unusable, so in a child both
// unregister() and the destructor forget the registration without a call.
class HostPin {
 public:
  HostPin(uint64_t ptr, uint64_t nbytes, int device);
  ~HostPin();
  HostPin(const HostPin&) = delete;
  HostPin& operator=(const HostPin&) = delete;

  // Unregisters now; idempotent. Throws CudaError when the runtime refuses
  // (the registration is considered gone all the same: never retried).
  void unregister();

  // Registered in this process and not unregistered yet.
  bool registered() const;

  uint64_t ptr() const { return ptr_; }
  uint64_t nbytes() const { return nbytes_; }

 private:
  uint64_t ptr_, nbytes_;
  pid_t pid_;  // the process that registered
  std::atomic<bool> live_{false};
};

}  // namespace mapoffload
