#include "host_pin.hpp"

#include <unistd.h>

#include "cuda_api.hpp"

namespace mapoffload {

void host_register(void* ptr, size_t nbytes, int device) {
  const CudaApi& api = cuda_api();
  DeviceScope scope(device);  // a context is made for this device, not for whatever the thread had
  // Portable: pinned for every context, whichever device copies from it.
  check_cuda(api.HostRegister(ptr, nbytes, kCudaHostRegisterPortable), "cudaHostRegister", __FILE__, __LINE__);
}

void host_unregister(void* ptr) {
  check_cuda(cuda_api().HostUnregister(ptr), "cudaHostUnregister", __FILE__, __LINE__);
}

HostPin::HostPin(uint64_t ptr, uint64_t nbytes, int device) : ptr_(ptr), nbytes_(nbytes), pid_(getpid()) {
  host_register(reinterpret_cast<void*>(ptr), static_cast<size_t>(nbytes), device);
  live_.store(true);
}

HostPin::~HostPin() {
  try {
    unregister();
  } catch (...) {
    // A destructor does not throw: the runtime refused (a sticky error, or
    // CUDA torn down at exit), and there is nothing else to undo.
  }
}

void HostPin::unregister() {
  if (!live_.exchange(false)) return;
  if (getpid() != pid_) return;  // a forked child: nothing is locked here, and CUDA is the parent's
  host_unregister(reinterpret_cast<void*>(ptr_));
}

bool HostPin::registered() const { return live_.load() && getpid() == pid_; }

}  // namespace mapoffload
