#include "cuda_api.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>

namespace mapoffload {

CudaError::CudaError(const std::string& call, int code, const std::string& what, const char* file, int line)
    : std::runtime_error(call + " failed: " + what + " (error " + std::to_string(code) + ") at " + file + ":" +
                         std::to_string(line)),
      code_(code) {}

namespace {

// Newest first: torch wheels ship libcudart.so.12 or .13; a toolkit gives libcudart.so.
const char* const kSonames[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"};

void* open_runtime(std::string& which) {
  // An explicit choice (a stand-in runtime for tests, a specific toolkit)
  // must load: falling back silently would test or use another library.
  if (const char* env = std::getenv("MAPOFFLOAD_CUDART"); env && *env) {
    void* h = dlopen(env, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* err = dlerror();
      throw CudaError(std::string("dlopen(MAPOFFLOAD_CUDART=") + env + ")", -1, err ? err : "cannot open", __FILE__,
                      __LINE__);
    }
    which = env;
    return h;
  }
  // First the runtime torch already loaded (same library, same context, same
  // streams), then any that opens.
  for (int flags : {RTLD_NOW | RTLD_NOLOAD, RTLD_NOW | RTLD_LOCAL}) {
    for (const char* name : kSonames) {
      if (void* h = dlopen(name, flags)) {
        which = name;
        return h;
      }
    }
  }
  return nullptr;
}

template <typename F>
void get_symbol(void* lib, F& fn, const char* name) {
  dlerror();
  void* p = dlsym(lib, name);
  const char* err = dlerror();
  if (err || !p) throw CudaError(std::string("dlsym(") + name + ")", -1, err ? err : "symbol is null", __FILE__, __LINE__);
  fn = reinterpret_cast<F>(p);
}

CudaApi load() {
  CudaApi api{};
  void* lib = open_runtime(api.library);
  if (!lib) {
    const char* err = dlerror();
    throw CudaError("dlopen(libcudart)", -1, err ? err : "no CUDA runtime library found", __FILE__, __LINE__);
  }
  get_symbol(lib, api.GetDeviceCount, "cudaGetDeviceCount");
  get_symbol(lib, api.SetDevice, "cudaSetDevice");
  get_symbol(lib, api.GetDevice, "cudaGetDevice");
  get_symbol(lib, api.HostAlloc, "cudaHostAlloc");
  get_symbol(lib, api.FreeHost, "cudaFreeHost");
  get_symbol(lib, api.HostRegister, "cudaHostRegister");
  get_symbol(lib, api.HostUnregister, "cudaHostUnregister");
  get_symbol(lib, api.MemcpyAsync, "cudaMemcpyAsync");
  get_symbol(lib, api.EventCreateWithFlags, "cudaEventCreateWithFlags");
  get_symbol(lib, api.EventRecord, "cudaEventRecord");
  get_symbol(lib, api.EventSynchronize, "cudaEventSynchronize");
  get_symbol(lib, api.EventQuery, "cudaEventQuery");
  get_symbol(lib, api.EventDestroy, "cudaEventDestroy");
  get_symbol(lib, api.StreamWaitEvent, "cudaStreamWaitEvent");
  get_symbol(lib, api.StreamSynchronize, "cudaStreamSynchronize");
  get_symbol(lib, api.GetLastError, "cudaGetLastError");
  get_symbol(lib, api.GetErrorString, "cudaGetErrorString");
  return api;
}

}  // namespace

const CudaApi& cuda_api() {
  // A failed load is retried on the next call (a library may appear later,
  // e.g. after torch initialises CUDA).
  static std::mutex mu;
  static CudaApi* api = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  if (!api) api = new CudaApi(load());  // never freed: lives as long as the process
  return *api;
}

bool cuda_available() {
  try {
    const CudaApi& api = cuda_api();
    int n = 0;
    if (api.GetDeviceCount(&n) == kCudaSuccess) return n > 0;
    api.GetLastError();  // "no device" is an answer here, not an error left for torch's next check
    return false;
  } catch (const CudaError&) {
    return false;
  }
}

void check_cuda(cudaError_t err, const char* call, const char* file, int line) {
  if (err == kCudaSuccess) return;
  const char* what = "unknown error";
  try {
    const CudaApi& api = cuda_api();
    if (const char* s = api.GetErrorString(err)) what = s;
    // The failure travels as the exception: take it out of this thread's
    // last-error slot too. Left there, torch's next launch check on this
    // thread (C10_CUDA_KERNEL_LAUNCH_CHECK: cudaGetLastError) would raise it
    // from an unrelated kernel. A sticky error stays (it cannot be cleared).
    api.GetLastError();
  } catch (...) {
  }
  throw CudaError(call, err, what, file, line);
}

DeviceScope::DeviceScope(int dev) {
  if (dev < 0) return;
  const CudaApi& api = cuda_api();
  int cur = -1;
  MAPOFFLOAD_CUDA_CHECK(api.GetDevice(&cur));
  if (cur != dev) {
    MAPOFFLOAD_CUDA_CHECK(api.SetDevice(dev));
    prev = cur;
  }
}

DeviceScope::~DeviceScope() {
  if (prev >= 0) cuda_api().SetDevice(prev);
}

}  // namespace mapoffload
