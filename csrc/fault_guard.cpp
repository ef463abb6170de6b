#include "fault_guard.hpp"

#include <setjmp.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>

namespace mapoffload {

namespace {

struct Guard {
  volatile sig_atomic_t active = 0;
  uintptr_t lo = 0, hi = 0;
  uintptr_t fault = 0;
  sigjmp_buf env;
};

// initial-exec: the handler must not call __tls_get_addr (not async-signal-safe).
__attribute__((tls_model("initial-exec"))) thread_local Guard t_guard;

std::mutex g_mu;                    // serialises (re)installation
struct sigaction g_previous;        // what SIGBUS did before our latest installation
std::atomic<bool> g_forwarded{false};  // a SIGBUS was forwarded since we last took first place

void on_sigbus(int sig, siginfo_t* info, void* ctx);

bool is_ours(const struct sigaction& sa) {
  return (sa.sa_flags & SA_SIGINFO) && sa.sa_sigaction == on_sigbus;
}

// Put the previous disposition back and let the signal reach it, as if we
// had never been installed. A kernel fault (si_code > 0) re-executes the
// faulting instruction on return and is delivered afresh, with its own
// siginfo; a sent signal (kill, tgkill, raise, sigqueue: si_code <= 0) is
// queued again to this thread and delivered once this handler returns (the
// signal is blocked while it runs).
void forward(int sig, siginfo_t* info) {
  struct sigaction prev = g_previous;
  // A handler that hands the signal straight back to us (faulthandler
  // restores the handler it displaced — ours — and re-raises) would make a
  // loop: the second time round, fall back to the default action.
  if (is_ours(prev) || g_forwarded.exchange(true)) {
    std::memset(&prev, 0, sizeof prev);
    prev.sa_handler = SIG_DFL;
    sigemptyset(&prev.sa_mask);
  }
  sigaction(sig, &prev, nullptr);
  if (info->si_code > 0) return;
  if (syscall(SYS_rt_tgsigqueueinfo, getpid(), static_cast<pid_t>(syscall(SYS_gettid)), sig, info) != 0)
    raise(sig);
}

void on_sigbus(int sig, siginfo_t* info, void* ctx) {
  (void)ctx;
  Guard& g = t_guard;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(info->si_addr);
  if (info->si_code > 0 && g.active && addr >= g.lo && addr < g.hi) {
    g.fault = addr;
    g.active = 0;
    siglongjmp(g.env, 1);
  }
  forward(sig, info);
}

}  // namespace

void install_fault_guard() {
  struct sigaction cur;
  if (sigaction(SIGBUS, nullptr, &cur) == 0 && is_ours(cur)) return;
  std::lock_guard<std::mutex> lock(g_mu);
  if (sigaction(SIGBUS, nullptr, &cur) != 0 || is_ours(cur)) return;
  // Whatever is installed now (the default, faulthandler, a Python handler)
  // becomes what we forward to.
  g_previous = cur;
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_sigbus;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  g_forwarded.store(false);
  sigaction(SIGBUS, &sa, nullptr);
}

namespace {

// Runs body() with a SIGBUS in [src, src + n) turned into a false return (the
// faulting address in *fault_addr). The jump lands in this frame, which stays
// live while body runs; body keeps no state across it.
template <class Body>
bool guarded(const void* src, size_t n, uint64_t* fault_addr, Body&& body) {
  if (n == 0) return true;
  Guard& g = t_guard;
  g.lo = reinterpret_cast<uintptr_t>(src);
  g.hi = g.lo + n;
  if (sigsetjmp(g.env, 1) != 0) {
    if (fault_addr) *fault_addr = g.fault;
    return false;
  }
  g.active = 1;
  body();
  g.active = 0;
  return true;
}

}  // namespace

bool guarded_memcpy(void* dst, const void* src, size_t n, uint64_t* fault_addr) {
  return guarded(src, n, fault_addr, [&] { std::memcpy(dst, src, n); });
}

bool guarded_touch(const void* src, size_t n, size_t stride, uint64_t* fault_addr) {
  if (stride == 0) stride = 1;
  return guarded(src, n, fault_addr, [&] {
    const volatile unsigned char* p = static_cast<const volatile unsigned char*>(src);
    unsigned char sink = 0;
    for (size_t off = 0; off < n; off += stride) sink ^= p[off];
    (void)sink;
  });
}

bool guarded_call(const void* lo, size_t n, void (*fn)(void*), void* ctx, uint64_t* fault_addr) {
  if (n == 0) {
    fn(ctx);  // nothing to guard: run it all the same
    return true;
  }
  return guarded(lo, n, fault_addr, [&] { fn(ctx); });
}

}  // namespace mapoffload
