#include "fault_guard.hpp"

#include <setjmp.h>
#include <signal.h>

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

struct sigaction g_previous;

void chain(int sig, siginfo_t* info, void* ctx) {
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction) {
      g_previous.sa_sigaction(sig, info, ctx);
      return;
    }
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(sig);
    return;
  }
  // Default action: restore it and return; the faulting instruction runs
  // again and the kernel delivers SIGBUS with the default disposition.
  signal(sig, SIG_DFL);
}

void on_sigbus(int sig, siginfo_t* info, void* ctx) {
  Guard& g = t_guard;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(info->si_addr);
  if (g.active && addr >= g.lo && addr < g.hi) {
    g.fault = addr;
    g.active = 0;
    siglongjmp(g.env, 1);
  }
  chain(sig, info, ctx);
}

}  // namespace

void install_fault_guard() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &g_previous);
  });
}

bool guarded_memcpy(void* dst, const void* src, size_t n, uint64_t* fault_addr) {
  if (n == 0) return true;
  Guard& g = t_guard;
  g.lo = reinterpret_cast<uintptr_t>(src);
  g.hi = g.lo + n;
  if (sigsetjmp(g.env, 1) != 0) {
    if (fault_addr) *fault_addr = g.fault;
    return false;
  }
  g.active = 1;
  std::memcpy(dst, src, n);
  g.active = 0;
  return true;
}

}  // namespace mapoffload
