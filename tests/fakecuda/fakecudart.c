/* A stand-in CUDA runtime for the test suite (plain C11 + pthreads).
 *
 * It exports the C ABI of the libcudart entry points mapoffload's copier
 * opens with dlopen (MAPOFFLOAD_CUDART=path), and emulates a GPU with host
 * memory:
 *
 *   - "device memory" (cudaMalloc) and pinned memory (cudaHostAlloc,
 *     cudaHostRegister) are host memory tracked in a registry;
 *   - every stream has a FIFO of operations run in order by its own worker
 *     thread, asynchronously from the caller: a copy reads its source and
 *     writes its destination when the engine reaches it, after a configurable
 *     delay per operation and bandwidth, so a caller that refills a pinned
 *     buffer before the copy out of it ran sees wrong bytes land;
 *   - events complete when their stream reaches them; cudaStreamWaitEvent
 *     orders later work of a stream after an event's recorded point;
 *   - the legacy default stream (0): work on it waits for the work already
 *     queued on every blocking stream, and work queued on a blocking stream
 *     waits for the work already queued on stream 0 (streams created with
 *     cudaStreamNonBlocking opt out), as in CUDA's legacy semantics.
 *     cudaStreamPerThread (0x2) is treated as the legacy stream too. It is
 *     one stream for every device; the calls that name it are counted per
 *     device current at the call (null_stream_uses_devN);
 *   - pageable sources: cudaMemcpyAsync host->device from memory that is not
 *     pinned first waits for the stream to drain, then snapshots the source
 *     (as the real runtime stages pageable memory), so the caller may reuse
 *     the source when the call returns; device->host into pageable memory
 *     returns once the copy has landed;
 *   - cudaFree and cudaFreeHost synchronize the device first, as the real
 *     runtime does;
 *   - after fork(), every call in the child returns
 *     cudaErrorInitializationError (switchable).
 *
 * Faults and counters are driven through the exported fakecuda_* functions
 * (tests call them with ctypes; dlopen of the same path returns the same
 * handle, so the copier and the test share this state). See tests/fakecuda.py.
 *
 * Not emulated: kernels (beyond fakecuda_enqueue_fill / host ops), timing
 * events, multiple contexts, peer access, graphs, managed memory, per-thread
 * default streams (0x2 is the legacy stream here).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

typedef int cudaError_t;

enum {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInitializationError = 3,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotReady = 600,
  cudaErrorIllegalAddress = 700,
  cudaErrorHostMemoryAlreadyRegistered = 712,
  cudaErrorHostMemoryNotRegistered = 713,
  cudaErrorLaunchFailure = 719,
};

enum { kH2H = 0, kH2D = 1, kD2H = 2, kD2D = 3, kDefault = 4 };
enum { kStreamNonBlocking = 1 };

/* --- function table (names for counters and fault rules) ------------------ */

#define FC_FUNCS(X)                                                                                     \
  X(cudaGetDeviceCount) X(cudaSetDevice) X(cudaGetDevice) X(cudaHostAlloc) X(cudaFreeHost) X(cudaMalloc) \
  X(cudaFree) X(cudaMemcpyAsync) X(cudaMemcpy) X(cudaStreamCreate) X(cudaStreamCreateWithFlags)          \
  X(cudaStreamDestroy) X(cudaStreamSynchronize) X(cudaStreamQuery) X(cudaStreamWaitEvent)                \
  X(cudaEventCreate) X(cudaEventCreateWithFlags) X(cudaEventRecord) X(cudaEventQuery)                    \
  X(cudaEventSynchronize) X(cudaEventDestroy) X(cudaDeviceSynchronize) X(cudaGetLastError)               \
  X(cudaPeekAtLastError) X(cudaHostRegister) X(cudaHostUnregister) X(cudaPointerGetAttributes)

#define FC_ENUM(n) F_##n,
enum { FC_FUNCS(FC_ENUM) F_COUNT };
#define FC_NAME(n) #n,
static const char* const fn_names[F_COUNT] = {FC_FUNCS(FC_NAME)};

static int fn_index(const char* name) {
  if (!name) return -1;
  for (int i = 0; i < F_COUNT; ++i)
    if (strcmp(fn_names[i], name) == 0) return i;
  return -1;
}

/* --- state ------------------------------------------------------------------ */

typedef struct fc_event fc_event;
typedef struct fc_stream fc_stream;

enum { OP_COPY, OP_FILL, OP_HOST, OP_RECORD, OP_WAIT_EVENT, OP_WAIT_STREAM, OP_GATE };

typedef struct op {
  struct op* next;
  int type;
  int counted; /* copy/fill/host: counts in pending_ops */
  void* dst;
  const void* src;
  size_t n;
  void* owned; /* snapshot of a pageable source, freed with the op */
  int byte;
  unsigned delay_us;
  fc_event* ev;
  uint64_t gen;
  fc_stream* ws;
  uint64_t wseq;
  void (*fn)(void*);
  void* arg;
  int gate;
  uint64_t deadline_ns;
} op;

struct fc_stream {
  fc_stream* next_all;
  op *head, *tail;
  uint64_t enq_seq, done_seq;
  int refs;
  int destroyed;
  int is_default;
  int blocking;
  int has_worker;
};

struct fc_event {
  fc_event* next_live;
  uint64_t record_gen, done_gen;
  int refs;
  unsigned flags;
};

enum { K_DEVICE = 1, K_PINNED = 2, K_REGISTERED = 3 };
typedef struct {
  uintptr_t base;
  size_t n;
  int kind;
} region;

typedef struct {
  int fn, after, error, sticky, times; /* times < 0: forever */
  long seen;
} rule;

#define MAX_RULES 64

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv; /* every state change broadcasts here (CLOCK_MONOTONIC) */
static pid_t g_pid;

static fc_stream* g_streams;   /* every stream alive or draining, the default one included */
static fc_stream* g_default;   /* created on first use */
static fc_event* g_events;     /* live (not destroyed) events */
static region* g_regions;
static size_t g_nregions, g_capregions;
static rule g_rules[MAX_RULES];
static int g_nrules;

/* settings (reset to these defaults by fakecuda_reset) */
static unsigned g_delay_us;
static double g_bandwidth; /* bytes/s; 0: unlimited */
static int g_strict = 1, g_fork_check = 1, g_device_count = 1, g_pageable_sync = 1;

/* errors */
static int g_sticky;        /* a sticky error: every call returns it until reset */
static int g_async_pending; /* a non-sticky asynchronous error, reported once by the next sync call */
static int g_async_arm, g_async_arm_sticky;
static unsigned g_epoch; /* bumps at reset: clears every thread's last error */
static int g_hurry;      /* draining for reset: skip delays */

#define MAX_GATES 1024
static unsigned char g_gate_open[MAX_GATES];
static int g_ngates;

/* counters */
static long long g_calls[F_COUNT];
static long long g_bytes, g_copies, g_fills, g_host_ops, g_snapshots, g_async_errors, g_injected;
static long long g_pending, g_max_pending;
static long long g_live_pinned, g_live_pinned_bytes, g_live_registered, g_live_device, g_live_device_bytes;
static long long g_live_events, g_live_streams;
/* Calls that named the legacy default stream (handle 0, 0x1, 0x2), by the
 * calling thread's current device: in CUDA that handle means the current
 * device's own default stream, so a call made with the wrong device current
 * orders the wrong device. (One stream stands for all of them here.) */
#define MAX_NULL_DEVICES 8
static long long g_null_uses[MAX_NULL_DEVICES];

static __thread int t_last;
static __thread unsigned t_epoch;
static __thread int t_device;

/* --- helpers ----------------------------------------------------------------- */

/* Settings read without the lock (fork check, device count, epoch) go through these. */
#define LOAD(v) __atomic_load_n(&(v), __ATOMIC_RELAXED)
#define STORE(v, x) __atomic_store_n(&(v), (x), __ATOMIC_RELAXED)

static void set_last(int err) {
  if (err == cudaSuccess) return;
  t_last = err;
  t_epoch = LOAD(g_epoch);
}

static void fork_child(void);
static void fork_prepare(void) { pthread_mutex_lock(&g_mu); }
static void fork_parent(void) { pthread_mutex_unlock(&g_mu); }

__attribute__((constructor)) static void fc_init(void) {
  pthread_condattr_t a;
  pthread_condattr_init(&a);
  pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
  pthread_cond_init(&g_cv, &a);
  pthread_condattr_destroy(&a);
  g_pid = getpid();
  pthread_atfork(fork_prepare, fork_parent, fork_child);
}

static int in_forked_child(void) { return LOAD(g_fork_check) && getpid() != g_pid; }

/* Every API call starts here: fork check, sticky error, injected failures. */
static int enter(int f) {
  if (in_forked_child()) {
    set_last(cudaErrorInitializationError);
    return cudaErrorInitializationError;
  }
  int err = cudaSuccess;
  pthread_mutex_lock(&g_mu);
  g_calls[f]++;
  if (g_sticky) {
    err = g_sticky;
  } else {
    for (int i = 0; i < g_nrules; ++i) {
      rule* r = &g_rules[i];
      if (r->fn != f || r->times == 0) continue;
      if (++r->seen <= r->after) continue;
      err = r->error;
      if (r->times > 0) r->times--;
      if (r->sticky) {
        g_sticky = err;
        pthread_cond_broadcast(&g_cv);
      }
      g_injected++;
      break;
    }
  }
  pthread_mutex_unlock(&g_mu);
  set_last(err);
  return err;
}

static int ret(int err) {
  set_last(err);
  return err;
}

static void wait_cv(void) { pthread_cond_wait(&g_cv, &g_mu); }

/* A sync call reports an asynchronous error once (non-sticky) or always (sticky). */
static int take_async_locked(void) {
  if (g_sticky) return g_sticky;
  int e = g_async_pending;
  g_async_pending = 0;
  return e;
}

/* regions (locked) */
static region* find_exact(uintptr_t base, int kind) {
  for (size_t i = 0; i < g_nregions; ++i)
    if (g_regions[i].base == base && g_regions[i].kind == kind) return &g_regions[i];
  return NULL;
}

static region* find_containing(uintptr_t a, size_t n, int kind_a, int kind_b) {
  for (size_t i = 0; i < g_nregions; ++i) {
    region* r = &g_regions[i];
    if (r->kind != kind_a && r->kind != kind_b) continue;
    if (a >= r->base && a - r->base <= r->n && n <= r->n - (a - r->base)) return r;
  }
  return NULL;
}

static int overlaps(uintptr_t a, size_t n, int kind_a, int kind_b) {
  for (size_t i = 0; i < g_nregions; ++i) {
    region* r = &g_regions[i];
    if (r->kind != kind_a && r->kind != kind_b) continue;
    if (a < r->base + r->n && r->base < a + n) return 1;
  }
  return 0;
}

static int add_region(uintptr_t base, size_t n, int kind) {
  if (g_nregions == g_capregions) {
    size_t cap = g_capregions ? 2 * g_capregions : 64;
    region* p = realloc(g_regions, cap * sizeof *p);
    if (!p) return 0;
    g_regions = p;
    g_capregions = cap;
  }
  g_regions[g_nregions++] = (region){base, n, kind};
  return 1;
}

static void remove_region(region* r) { *r = g_regions[--g_nregions]; }

/* streams and events (locked) */
static void* worker(void* arg);

static int start_worker(fc_stream* s) {
  pthread_t t;
  pthread_attr_t a;
  pthread_attr_init(&a);
  pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
  int rc = pthread_create(&t, &a, worker, s);
  pthread_attr_destroy(&a);
  if (rc == 0) s->has_worker = 1;
  return rc == 0;
}

static void stream_unref(fc_stream* s) {
  if (--s->refs > 0) return;
  for (fc_stream** p = &g_streams; *p; p = &(*p)->next_all)
    if (*p == s) {
      *p = s->next_all;
      break;
    }
  if (g_default == s) g_default = NULL;
  free(s);
}

static void event_unref(fc_event* e) {
  if (--e->refs == 0) free(e);
}

static fc_stream* new_stream(int blocking, int is_default) {
  fc_stream* s = calloc(1, sizeof *s);
  if (!s) return NULL;
  s->blocking = blocking;
  s->is_default = is_default;
  s->refs = is_default ? 1 : 2; /* the worker's, and the handle's */
  s->next_all = g_streams;
  g_streams = s;
  if (!start_worker(s)) {
    g_streams = s->next_all;
    free(s);
    return NULL;
  }
  return s;
}

/* The stream a handle names, or NULL (invalid handle). 0, 0x1 (legacy) and
 * 0x2 (per-thread) are the legacy default stream. */
static fc_stream* resolve_stream(void* h, int* err) {
  *err = cudaSuccess;
  if ((uintptr_t)h <= 2) {
    if (t_device >= 0 && t_device < MAX_NULL_DEVICES) g_null_uses[t_device]++;
    if (!g_default) g_default = new_stream(1, 1);
    if (!g_default) *err = cudaErrorMemoryAllocation;
    return g_default;
  }
  for (fc_stream* s = g_streams; s; s = s->next_all)
    if (s == h && !s->destroyed && !s->is_default) return s;
  *err = cudaErrorInvalidResourceHandle;
  return NULL;
}

static fc_event* resolve_event(void* h) {
  for (fc_event* e = g_events; e; e = e->next_live)
    if (e == h) return e;
  return NULL;
}

static void push_op(fc_stream* s, op* o) {
  o->next = NULL;
  if (s->tail) s->tail->next = o;
  else s->head = o;
  s->tail = o;
  s->enq_seq++;
  if (o->counted && ++g_pending > g_max_pending) g_max_pending = g_pending;
  pthread_cond_broadcast(&g_cv);
}

static int push_wait_stream(fc_stream* s, fc_stream* on) {
  op* w = calloc(1, sizeof *w);
  if (!w) return 0;
  w->type = OP_WAIT_STREAM;
  w->ws = on;
  w->wseq = on->enq_seq;
  on->refs++;
  push_op(s, w);
  return 1;
}

/* Queue o on s, after the legacy default stream's implicit dependencies. */
static int enqueue(fc_stream* s, op* o) {
  if (s->is_default) {
    for (fc_stream* t = g_streams; t; t = t->next_all)
      if (t != s && t->blocking && t->done_seq < t->enq_seq && !push_wait_stream(s, t)) return 0;
  } else if (s->blocking && g_default && g_default->done_seq < g_default->enq_seq) {
    if (!push_wait_stream(s, g_default)) return 0;
  }
  push_op(s, o);
  return 1;
}

static uint64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

/* Sleep ns with g_mu held (released while waiting); a reset or a sticky error cuts it short. */
static void sleep_locked(uint64_t ns) {
  if (!ns) return;
  uint64_t end = now_ns() + ns;
  struct timespec dl = {(time_t)(end / 1000000000ull), (long)(end % 1000000000ull)};
  while (!g_hurry && !g_sticky)
    if (pthread_cond_timedwait(&g_cv, &g_mu, &dl) == ETIMEDOUT) break;
}

static void execute_locked(op* o) {
  switch (o->type) {
    case OP_WAIT_EVENT:
      while (o->ev->done_gen < o->gen) wait_cv();
      break;
    case OP_WAIT_STREAM:
      while (o->ws->done_seq < o->wseq) wait_cv();
      break;
    case OP_RECORD:
      if (o->ev->done_gen < o->gen) o->ev->done_gen = o->gen;
      break;
    case OP_COPY: {
      uint64_t ns = (uint64_t)g_delay_us * 1000u;
      if (g_bandwidth > 0) ns += (uint64_t)((double)o->n * 1e9 / g_bandwidth);
      sleep_locked(ns);
      if (g_sticky) break; /* a dead context runs nothing */
      if (g_async_arm) {
        int e = g_async_arm;
        g_async_arm = 0;
        g_async_errors++;
        if (g_async_arm_sticky) g_sticky = e;
        else g_async_pending = e;
        break;
      }
      pthread_mutex_unlock(&g_mu);
      memcpy(o->dst, o->owned ? o->owned : o->src, o->n);
      pthread_mutex_lock(&g_mu);
      g_bytes += (long long)o->n;
      g_copies++;
      break;
    }
    case OP_FILL:
      sleep_locked((uint64_t)o->delay_us * 1000u);
      if (g_sticky) break;
      pthread_mutex_unlock(&g_mu);
      memset(o->dst, o->byte, o->n);
      pthread_mutex_lock(&g_mu);
      g_fills++;
      break;
    case OP_GATE: {
      struct timespec dl = {(time_t)(o->deadline_ns / 1000000000ull), (long)(o->deadline_ns % 1000000000ull)};
      while (!g_gate_open[o->gate] && !g_hurry && !g_sticky)
        if (pthread_cond_timedwait(&g_cv, &g_mu, &dl) == ETIMEDOUT) break;
      break;
    }
    case OP_HOST:
      if (g_sticky) break;
      pthread_mutex_unlock(&g_mu);
      o->fn(o->arg);
      pthread_mutex_lock(&g_mu);
      g_host_ops++;
      break;
  }
}

static void* worker(void* arg) {
  fc_stream* s = arg;
  pthread_mutex_lock(&g_mu);
  for (;;) {
    while (!s->head && !s->destroyed) wait_cv();
    if (!s->head) break; /* destroyed and drained */
    op* o = s->head;
    execute_locked(o);
    s->head = o->next;
    if (!s->head) s->tail = NULL;
    s->done_seq++;
    if (o->counted) g_pending--;
    if (o->ev) event_unref(o->ev);
    if (o->ws) stream_unref(o->ws);
    free(o->owned);
    free(o);
    pthread_cond_broadcast(&g_cv);
  }
  s->has_worker = 0;
  stream_unref(s);
  pthread_cond_broadcast(&g_cv);
  pthread_mutex_unlock(&g_mu);
  return NULL;
}

static void wait_stream_locked(fc_stream* s, uint64_t seq) {
  s->refs++;
  while (s->done_seq < seq && !g_sticky) wait_cv();
  stream_unref(s);
}

/* Wait for the work queued on every stream now. */
static void device_sync_locked(void) {
  size_t n = 0;
  for (fc_stream* s = g_streams; s; s = s->next_all) n++;
  if (!n) return;
  fc_stream** ss = malloc(n * sizeof *ss);
  uint64_t* seq = malloc(n * sizeof *seq);
  if (!ss || !seq) { /* fall back to waiting for every queue to empty */
    free(ss);
    free(seq);
    for (;;) {
      int busy = 0;
      for (fc_stream* s = g_streams; s; s = s->next_all) busy |= s->head != NULL;
      if (!busy || g_sticky) return;
      wait_cv();
    }
  }
  size_t i = 0;
  for (fc_stream* s = g_streams; s; s = s->next_all, ++i) {
    ss[i] = s;
    seq[i] = s->enq_seq;
    s->refs++;
  }
  for (i = 0; i < n; ++i) {
    while (ss[i]->done_seq < seq[i] && !g_sticky) wait_cv();
  }
  for (i = 0; i < n; ++i) stream_unref(ss[i]);
  free(ss);
  free(seq);
}

static void fork_child(void) {
  /* The prepare handler locked g_mu in this very thread. */
  pthread_mutex_unlock(&g_mu);
  pthread_mutex_init(&g_mu, NULL);
  pthread_condattr_t a;
  pthread_condattr_init(&a);
  pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
  pthread_cond_init(&g_cv, &a);
  pthread_condattr_destroy(&a);
  /* No worker survived the fork. With the fork check off, emulate a runtime
   * that works in the child: restart a worker per stream (an operation that
   * was executing at the fork runs again from its start). */
  for (fc_stream* s = g_streams; s; s = s->next_all) {
    s->has_worker = 0;
    if (!g_fork_check) start_worker(s);
  }
}

/* --- device -------------------------------------------------------------------- */

EXPORT cudaError_t cudaGetDeviceCount(int* count) {
  int err = enter(F_cudaGetDeviceCount);
  if (err) return err;
  if (!count) return ret(cudaErrorInvalidValue);
  int n = LOAD(g_device_count);
  *count = n;
  return ret(n > 0 ? cudaSuccess : cudaErrorNoDevice);
}

EXPORT cudaError_t cudaSetDevice(int device) {
  int err = enter(F_cudaSetDevice);
  if (err) return err;
  if (device < 0 || device >= LOAD(g_device_count)) return ret(cudaErrorInvalidDevice);
  t_device = device;
  return cudaSuccess;
}

EXPORT cudaError_t cudaGetDevice(int* device) {
  int err = enter(F_cudaGetDevice);
  if (err) return err;
  if (!device) return ret(cudaErrorInvalidValue);
  *device = t_device;
  return cudaSuccess;
}

EXPORT cudaError_t cudaDeviceSynchronize(void) {
  int err = enter(F_cudaDeviceSynchronize);
  if (err) return err;
  pthread_mutex_lock(&g_mu);
  device_sync_locked();
  err = take_async_locked();
  pthread_mutex_unlock(&g_mu);
  return ret(err);
}

/* --- memory -------------------------------------------------------------------- */

static size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

EXPORT cudaError_t cudaHostAlloc(void** ptr, size_t size, unsigned flags) {
  (void)flags;
  int err = enter(F_cudaHostAlloc);
  if (err) return err;
  if (!ptr) return ret(cudaErrorInvalidValue);
  *ptr = NULL;
  void* p = aligned_alloc(4096, round_up(size ? size : 1, 4096));
  if (!p) return ret(cudaErrorMemoryAllocation);
  pthread_mutex_lock(&g_mu);
  if (!add_region((uintptr_t)p, size, K_PINNED)) err = cudaErrorMemoryAllocation;
  else {
    g_live_pinned++;
    g_live_pinned_bytes += (long long)size;
  }
  pthread_mutex_unlock(&g_mu);
  if (err) {
    free(p);
    return ret(err);
  }
  *ptr = p;
  return cudaSuccess;
}

EXPORT cudaError_t cudaFreeHost(void* ptr) {
  int err = enter(F_cudaFreeHost);
  if (err) return err;
  if (!ptr) return cudaSuccess;
  pthread_mutex_lock(&g_mu);
  device_sync_locked(); /* as the real runtime: no copy still reads it */
  region* r = find_exact((uintptr_t)ptr, K_PINNED);
  if (!r) err = cudaErrorInvalidValue;
  else if (g_sticky) err = g_sticky;
  else {
    g_live_pinned--;
    g_live_pinned_bytes -= (long long)r->n;
    remove_region(r);
  }
  pthread_mutex_unlock(&g_mu);
  if (!err) free(ptr);
  return ret(err);
}

EXPORT cudaError_t cudaMalloc(void** ptr, size_t size) {
  int err = enter(F_cudaMalloc);
  if (err) return err;
  if (!ptr) return ret(cudaErrorInvalidValue);
  *ptr = NULL;
  if (size == 0) return cudaSuccess;
  void* p = aligned_alloc(256, round_up(size, 256));
  if (!p) return ret(cudaErrorMemoryAllocation);
  pthread_mutex_lock(&g_mu);
  if (!add_region((uintptr_t)p, size, K_DEVICE)) err = cudaErrorMemoryAllocation;
  else {
    g_live_device++;
    g_live_device_bytes += (long long)size;
  }
  pthread_mutex_unlock(&g_mu);
  if (err) {
    free(p);
    return ret(err);
  }
  *ptr = p;
  return cudaSuccess;
}

EXPORT cudaError_t cudaFree(void* ptr) {
  int err = enter(F_cudaFree);
  if (err) return err;
  if (!ptr) return cudaSuccess;
  pthread_mutex_lock(&g_mu);
  device_sync_locked();
  region* r = find_exact((uintptr_t)ptr, K_DEVICE);
  if (!r) err = cudaErrorInvalidValue;
  else if (g_sticky) err = g_sticky;
  else {
    g_live_device--;
    g_live_device_bytes -= (long long)r->n;
    remove_region(r);
  }
  pthread_mutex_unlock(&g_mu);
  if (!err) free(ptr);
  return ret(err);
}

EXPORT cudaError_t cudaHostRegister(void* ptr, size_t size, unsigned flags) {
  (void)flags;
  int err = enter(F_cudaHostRegister);
  if (err) return err;
  if (!ptr || !size) return ret(cudaErrorInvalidValue);
  pthread_mutex_lock(&g_mu);
  if (overlaps((uintptr_t)ptr, size, K_PINNED, K_REGISTERED)) err = cudaErrorHostMemoryAlreadyRegistered;
  else if (overlaps((uintptr_t)ptr, size, K_DEVICE, K_DEVICE)) err = cudaErrorInvalidValue;
  else if (!add_region((uintptr_t)ptr, size, K_REGISTERED)) err = cudaErrorMemoryAllocation;
  else g_live_registered++;
  pthread_mutex_unlock(&g_mu);
  return ret(err);
}

EXPORT cudaError_t cudaHostUnregister(void* ptr) {
  int err = enter(F_cudaHostUnregister);
  if (err) return err;
  pthread_mutex_lock(&g_mu);
  device_sync_locked();
  region* r = find_exact((uintptr_t)ptr, K_REGISTERED);
  if (!r) err = cudaErrorHostMemoryNotRegistered;
  else {
    remove_region(r);
    g_live_registered--;
  }
  pthread_mutex_unlock(&g_mu);
  return ret(err);
}

struct cudaPointerAttributes {
  int type; /* 0 unregistered, 1 host (pinned), 2 device, 3 managed */
  int device;
  void* devicePointer;
  void* hostPointer;
};

EXPORT cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes* attr, const void* ptr) {
  int err = enter(F_cudaPointerGetAttributes);
  if (err) return err;
  if (!attr) return ret(cudaErrorInvalidValue);
  memset(attr, 0, sizeof *attr);
  pthread_mutex_lock(&g_mu);
  if (find_containing((uintptr_t)ptr, 0, K_DEVICE, K_DEVICE)) {
    attr->type = 2;
    attr->devicePointer = (void*)ptr;
  } else if (find_containing((uintptr_t)ptr, 0, K_PINNED, K_REGISTERED)) {
    attr->type = 1;
    attr->devicePointer = attr->hostPointer = (void*)ptr;
  }
  pthread_mutex_unlock(&g_mu);
  return cudaSuccess;
}

/* --- copies -------------------------------------------------------------------- */

/* Checks and queues one copy on s (locked). *wait_seq: the stream position the
 * caller must wait for before returning (0: none). */
static int queue_copy_locked(void* dst, const void* src, size_t n, int kind, fc_stream* s, int sync_call,
                             uint64_t* wait_seq) {
  *wait_seq = 0;
  uintptr_t d = (uintptr_t)dst, sr = (uintptr_t)src;
  int src_dev = overlaps(sr, n, K_DEVICE, K_DEVICE), dst_dev = overlaps(d, n, K_DEVICE, K_DEVICE);
  if (kind == kDefault) kind = src_dev ? (dst_dev ? kD2D : kD2H) : (dst_dev ? kH2D : kH2H);
  if (kind < kH2H || kind > kD2D) return cudaErrorInvalidValue;
  if (g_strict) {
    int dst_ok = (kind == kH2D || kind == kD2D) ? find_containing(d, n, K_DEVICE, K_DEVICE) != NULL : !dst_dev;
    int src_ok = (kind == kD2H || kind == kD2D) ? find_containing(sr, n, K_DEVICE, K_DEVICE) != NULL : !src_dev;
    if (!dst_ok || !src_ok) return cudaErrorInvalidValue;
  }
  int src_host = kind == kH2D || kind == kH2H;
  int dst_host = kind == kD2H || kind == kH2H;
  int src_pinned = find_containing(sr, n, K_PINNED, K_REGISTERED) != NULL;
  int dst_pinned = find_containing(d, n, K_PINNED, K_REGISTERED) != NULL;
  op* o = calloc(1, sizeof *o);
  if (!o) return cudaErrorMemoryAllocation;
  o->type = OP_COPY;
  o->counted = 1;
  o->dst = dst;
  o->src = src;
  o->n = n;
  if (src_host && !src_pinned && !sync_call) {
    /* Pageable source: the runtime syncs the stream, then stages the bytes
     * before returning, so the caller may reuse the source at once. */
    if (g_pageable_sync) wait_stream_locked(s, s->enq_seq);
    if (g_sticky) {
      free(o);
      return g_sticky;
    }
    o->owned = malloc(n);
    if (!o->owned) {
      free(o);
      return cudaErrorMemoryAllocation;
    }
    s->refs++; /* the stream outlives the unlocked copy even if destroyed meanwhile */
    pthread_mutex_unlock(&g_mu);
    memcpy(o->owned, src, n);
    pthread_mutex_lock(&g_mu);
    g_snapshots++;
    int gone = s->destroyed && !s->has_worker;
    stream_unref(s);
    if (gone) {
      free(o->owned);
      free(o);
      return cudaErrorInvalidResourceHandle;
    }
  }
  if (!enqueue(s, o)) {
    free(o->owned);
    free(o);
    return cudaErrorMemoryAllocation;
  }
  if (sync_call || (dst_host && !dst_pinned)) *wait_seq = s->enq_seq;
  return cudaSuccess;
}

EXPORT cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, int kind, void* stream) {
  int err = enter(F_cudaMemcpyAsync);
  if (err) return err;
  if (count == 0) return cudaSuccess;
  if (!dst || !src) return ret(cudaErrorInvalidValue);
  pthread_mutex_lock(&g_mu);
  fc_stream* s = resolve_stream(stream, &err);
  uint64_t seq = 0;
  if (s) err = queue_copy_locked(dst, src, count, kind, s, 0, &seq);
  if (!err && seq) {
    wait_stream_locked(s, seq);
    err = take_async_locked();
  }
  pthread_mutex_unlock(&g_mu);
  return ret(err);
}

EXPORT cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, int kind) {
  int err = enter(F_cudaMemcpy);
  if (err) return err;
  if (count == 0) return cudaSuccess;
  if (!dst || !src) return ret(cudaErrorInvalidValue);
  pthread_mutex_lock(&g_mu);
  fc_stream* s = resolve_stream(NULL, &err);
  uint64_t seq = 0;
  if (s) err = queue_copy_locked(dst, src, count, kind, s, 1, &seq);
  if (!err) {
    wait_stream_locked(s, seq);
    err = take_async_locked();
  }
  pthread_mutex_unlock(&g_mu);
  return ret(err);
}

/* --- streams -------------------------------------------------------------------- */

EXPORT cudaError_t cudaStreamCreateWithFlags(void** stream, unsigned flags) {
  int err = enter(F_cudaStreamCreateWithFlags);
  if (err) return err;
  if (!stream) return ret(cudaErrorInvalidValue);
  pthread_mutex_lock(&g_mu);
  fc_stream* s = new_stream(!(flags & kStreamNonBlocking), 0);
  if (s) g_live_streams++;
  pthread_mutex_unlock(&g_mu);
  if (!s) return ret(cudaErrorMemoryAllocation);
  *stream = s;
  return cudaSuccess;
}

EXPORT cudaError_t cudaStreamCreate(void** stream) {
  int err = enter(F_cudaStreamCreate);
  if (err) return err;
  if (!stream) return ret(cudaErrorInvalidValue);
  pthread_mutex_lock(&g_mu);
  fc_stream* s = new_stream(1, 0);
  if (s) g_live_streams++;
  pthread_mutex_unlock(&g_mu);
  if (!s) return ret(cudaErrorMemoryAllocation);
  *stream = s;
  return cudaSuccess;
}

EXPORT cudaError_t cudaStreamDestroy(void* stream) {
  int err = enter(F_cudaStreamDestroy);
  if (err) return err;
  pthread_mutex_lock(&g_mu);
  fc_stream* s = NULL;
  if ((uintptr_t)stream > 2) s = resolve_stream(stream, &err);
  else err = cudaErrorInvalidResourceHandle;
  if (s) {
    /* Returns at once; queued work still runs, then the worker frees it. */
    s->destroyed = 1;
    g_live_streams--;
    stream_unref(s);
    pthread_cond_broadcast(&g_cv);
  }
  pthread_mutex_unlock(&g_mu);
  return ret(err);
}

EXPORT cudaError_t cudaStreamSynchronize(void* stream) {
  int err = enter(F_cudaStreamSynchronize);
  if (err) return err;
  pthread_mutex_lock(&g_mu);
  fc_stream* s = resolve_stream(stream, &err);
  if (s) {
    wait_stream_locked(s, s->enq_seq);
    err = take_async_locked();
  }
  pthread_mutex_unlock(&g_mu);
  return ret(err);
}

EXPORT cudaError_t cudaStreamQuery(void* stream) {
  int err = enter(F_cudaStreamQuery);
  if (err) return err;
  pthread_mutex_lock(&g_mu);
  fc_stream* s = resolve_stream(stream, &err);
  if (s) {
    err = take_async_locked();
    if (!err && s->done_seq < s->enq_seq) err = cudaErrorNotReady;
  }
  pthread_mutex_unlock(&g_mu);
  return ret(err);
}

EXPORT cudaError_t cudaStreamWaitEvent(void* stream, void* event, unsigned flags) {
  (void)flags;
  int err = enter(F_cudaStreamWaitEvent);
  if (err) return err;
  pthread_mutex_lock(&g_mu);
  fc_stream* s = resolve_stream(stream, &err);
  fc_event* e = s ? resolve_event(event) : NULL;
  if (s && !e) err = cudaErrorInvalidResourceHandle;
  if (e && e->done_gen < e->record_gen) { /* an event never recorded, or complete: nothing to wait for */
    op* o = calloc(1, sizeof *o);
    if (!o) err = cudaErrorMemoryAllocation;
    else {
      o->type = OP_WAIT_EVENT;
      o->ev = e;
      o->gen = e->record_gen;
      e->refs++;
      if (!enqueue(s, o)) {
        e->refs--;
        free(o);
        err = cudaErrorMemoryAllocation;
      }
    }
  }
  pthread_mutex_unlock(&g_mu);
  return ret(err);
}

/* --- events --------------------------------------------------------------------- */

EXPORT cudaError_t cudaEventCreateWithFlags(void** event, unsigned flags) {
  int err = enter(F_cudaEventCreateWithFlags);
  if (err) return err;
  if (!event) return ret(cudaErrorInvalidValue);
  fc_event* e = calloc(1, sizeof *e);
  if (!e) return ret(cudaErrorMemoryAllocation);
  e->refs = 1;
  e->flags = flags;
  pthread_mutex_lock(&g_mu);
  e->next_live = g_events;
  g_events = e;
  g_live_events++;
  pthread_mutex_unlock(&g_mu);
  *event = e;
  return cudaSuccess;
}

EXPORT cudaError_t cudaEventCreate(void** event) {
  int err = enter(F_cudaEventCreate);
  if (err) return err;
  if (!event) return ret(cudaErrorInvalidValue);
  fc_event* e = calloc(1, sizeof *e);
  if (!e) return ret(cudaErrorMemoryAllocation);
  e->refs = 1;
  pthread_mutex_lock(&g_mu);
  e->next_live = g_events;
  g_events = e;
  g_live_events++;
  pthread_mutex_unlock(&g_mu);
  *event = e;
  return cudaSuccess;
}

EXPORT cudaError_t cudaEventDestroy(void* event) {
  int err = enter(F_cudaEventDestroy);
  if (err) return err;
  pthread_mutex_lock(&g_mu);
  fc_event* e = resolve_event(event);
  if (!e) err = cudaErrorInvalidResourceHandle;
  else {
    /* Allowed while a record is pending: freed once the stream passes it. */
    for (fc_event** p = &g_events; *p; p = &(*p)->next_live)
      if (*p == e) {
        *p = e->next_live;
        break;
      }
    g_live_events--;
    event_unref(e);
  }
  pthread_mutex_unlock(&g_mu);
  return ret(err);
}

EXPORT cudaError_t cudaEventRecord(void* event, void* stream) {
  int err = enter(F_cudaEventRecord);
  if (err) return err;
  pthread_mutex_lock(&g_mu);
  fc_event* e = resolve_event(event);
  fc_stream* s = e ? resolve_stream(stream, &err) : NULL;
  if (!e) err = cudaErrorInvalidResourceHandle;
  if (s) {
    op* o = calloc(1, sizeof *o);
    if (!o) err = cudaErrorMemoryAllocation;
    else {
      o->type = OP_RECORD;
      o->ev = e;
      o->gen = ++e->record_gen;
      e->refs++;
      if (!enqueue(s, o)) {
        e->refs--;
        e->record_gen--;
        free(o);
        err = cudaErrorMemoryAllocation;
      }
    }
  }
  pthread_mutex_unlock(&g_mu);
  return ret(err);
}

EXPORT cudaError_t cudaEventQuery(void* event) {
  int err = enter(F_cudaEventQuery);
  if (err) return err;
  pthread_mutex_lock(&g_mu);
  fc_event* e = resolve_event(event);
  if (!e) err = cudaErrorInvalidResourceHandle;
  else {
    err = take_async_locked();
    if (!err && e->done_gen < e->record_gen) err = cudaErrorNotReady;
  }
  pthread_mutex_unlock(&g_mu);
  return ret(err);
}

EXPORT cudaError_t cudaEventSynchronize(void* event) {
  int err = enter(F_cudaEventSynchronize);
  if (err) return err;
  pthread_mutex_lock(&g_mu);
  fc_event* e = resolve_event(event);
  if (!e) err = cudaErrorInvalidResourceHandle;
  else {
    uint64_t gen = e->record_gen;
    e->refs++;
    while (e->done_gen < gen && !g_sticky) wait_cv();
    event_unref(e);
    err = take_async_locked();
  }
  pthread_mutex_unlock(&g_mu);
  return ret(err);
}

/* --- errors ---------------------------------------------------------------------- */

EXPORT cudaError_t cudaGetLastError(void) {
  int err = enter(F_cudaGetLastError);
  if (err) return err; /* sticky (or injected): returned, never cleared */
  int e = t_epoch == LOAD(g_epoch) ? t_last : 0;
  t_last = 0;
  return e;
}

EXPORT cudaError_t cudaPeekAtLastError(void) {
  int err = enter(F_cudaPeekAtLastError);
  if (err) return err;
  return t_epoch == LOAD(g_epoch) ? t_last : 0;
}

static const struct {
  int code;
  const char *name, *text;
} kErrors[] = {
    {cudaSuccess, "cudaSuccess", "no error"},
    {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
    {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
    {cudaErrorInitializationError, "cudaErrorInitializationError", "initialization error"},
    {cudaErrorNoDevice, "cudaErrorNoDevice", "no CUDA-capable device is detected"},
    {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
    {cudaErrorNotReady, "cudaErrorNotReady", "device not ready"},
    {cudaErrorIllegalAddress, "cudaErrorIllegalAddress", "an illegal memory access was encountered"},
    {cudaErrorHostMemoryAlreadyRegistered, "cudaErrorHostMemoryAlreadyRegistered",
     "part or all of the requested memory range is already mapped"},
    {cudaErrorHostMemoryNotRegistered, "cudaErrorHostMemoryNotRegistered",
     "pointer does not correspond to a registered memory region"},
    {cudaErrorLaunchFailure, "cudaErrorLaunchFailure", "unspecified launch failure"},
};

EXPORT const char* cudaGetErrorString(cudaError_t err) {
  for (size_t i = 0; i < sizeof kErrors / sizeof kErrors[0]; ++i)
    if (kErrors[i].code == err) return kErrors[i].text;
  return "unrecognized error code";
}

EXPORT const char* cudaGetErrorName(cudaError_t err) {
  for (size_t i = 0; i < sizeof kErrors / sizeof kErrors[0]; ++i)
    if (kErrors[i].code == err) return kErrors[i].name;
  return "cudaErrorUnknown";
}

/* --- control (tests) ---------------------------------------------------------------- */

/* Drains every stream (delays skipped), then clears faults, sticky and pending
 * errors, counters and settings. Live allocations, streams and events stay:
 * their owners may still use them; the live_* counters keep counting them. */
EXPORT void fakecuda_reset(void) {
  pthread_mutex_lock(&g_mu);
  g_hurry = 1;
  pthread_cond_broadcast(&g_cv);
  for (;;) {
    int busy = 0;
    for (fc_stream* s = g_streams; s; s = s->next_all)
      if (s->has_worker && (s->head || s->destroyed)) busy = 1;
    if (!busy) break;
    wait_cv();
  }
  g_hurry = 0;
  g_nrules = 0;
  g_sticky = g_async_pending = g_async_arm = g_async_arm_sticky = 0;
  g_delay_us = 0;
  g_bandwidth = 0;
  g_strict = g_pageable_sync = 1;
  STORE(g_fork_check, 1);
  STORE(g_device_count, 1);
  memset(g_calls, 0, sizeof g_calls);
  memset(g_null_uses, 0, sizeof g_null_uses);
  g_bytes = g_copies = g_fills = g_host_ops = g_snapshots = g_async_errors = g_injected = 0;
  g_max_pending = g_pending;
  memset(g_gate_open, 0, sizeof g_gate_open);
  g_ngates = 0;
  STORE(g_epoch, g_epoch + 1);
  pthread_mutex_unlock(&g_mu);
  t_last = 0;
}

EXPORT void fakecuda_set_delay_us(unsigned us) {
  pthread_mutex_lock(&g_mu);
  g_delay_us = us;
  pthread_mutex_unlock(&g_mu);
}

EXPORT void fakecuda_set_bandwidth(double bytes_per_s) {
  pthread_mutex_lock(&g_mu);
  g_bandwidth = bytes_per_s > 0 ? bytes_per_s : 0;
  pthread_mutex_unlock(&g_mu);
}

/* The (after_n+1)-th call of func from now on fails with error, and the next
 * times-1 calls after it (times < 0: every later call). sticky: the failure
 * also becomes the sticky error. Returns 0, or -1 (unknown function, too many
 * rules). */
EXPORT int fakecuda_fail_times(const char* func, int after_n, int error, int sticky, int times) {
  int f = fn_index(func);
  if (f < 0 || error == 0 || after_n < 0) return -1;
  pthread_mutex_lock(&g_mu);
  int rc = -1;
  if (g_nrules < MAX_RULES) {
    g_rules[g_nrules++] = (rule){f, after_n, error, sticky != 0, times, 0};
    rc = 0;
  }
  pthread_mutex_unlock(&g_mu);
  return rc;
}

EXPORT int fakecuda_fail(const char* func, int after_n, int error, int sticky) {
  return fakecuda_fail_times(func, after_n, error, sticky, 1);
}

/* The next copy the engine executes does not land and fails with error: it
 * surfaces at the next synchronizing call (EventSynchronize/Query,
 * StreamSynchronize/Query, DeviceSynchronize, Memcpy, a pageable
 * D2H MemcpyAsync) of any thread, on any event or stream, once; sticky: at
 * every later call of every function, and the engine runs nothing more (real
 * asynchronous faults are sticky; the non-sticky form is for error-path tests). */
EXPORT void fakecuda_fail_async(int error, int sticky) {
  pthread_mutex_lock(&g_mu);
  g_async_arm = error;
  g_async_arm_sticky = sticky != 0;
  pthread_mutex_unlock(&g_mu);
}

static int enqueue_ctl(void* stream, op* o) {
  pthread_mutex_lock(&g_mu);
  int err;
  fc_stream* s = resolve_stream(stream, &err);
  if (s && !enqueue(s, o)) err = cudaErrorMemoryAllocation;
  pthread_mutex_unlock(&g_mu);
  if (err) free(o);
  return err;
}

/* A fake kernel: after delay_us on the stream, memset(ptr, byte, n). With the
 * strict check on, ptr..ptr+n must be device memory. */
EXPORT int fakecuda_enqueue_fill(void* stream, void* ptr, int byte, size_t n, unsigned delay_us) {
  if (!ptr || !n) return cudaErrorInvalidValue;
  pthread_mutex_lock(&g_mu);
  int bad = g_strict && !find_containing((uintptr_t)ptr, n, K_DEVICE, K_DEVICE);
  pthread_mutex_unlock(&g_mu);
  if (bad) return cudaErrorInvalidValue;
  op* o = calloc(1, sizeof *o);
  if (!o) return cudaErrorMemoryAllocation;
  o->type = OP_FILL;
  o->counted = 1;
  o->dst = ptr;
  o->byte = byte;
  o->n = n;
  o->delay_us = delay_us;
  return enqueue_ctl(stream, o);
}

/* fn(arg) on the stream's worker thread, in stream order. */
EXPORT int fakecuda_enqueue_host_op(void* stream, void (*fn)(void*), void* arg) {
  if (!fn) return cudaErrorInvalidValue;
  op* o = calloc(1, sizeof *o);
  if (!o) return cudaErrorMemoryAllocation;
  o->type = OP_HOST;
  o->counted = 1;
  o->fn = fn;
  o->arg = arg;
  return enqueue_ctl(stream, o);
}

/* Holds the stream: work queued after this waits until fakecuda_release(id),
 * a reset, a sticky error, or timeout_us (0: 10 s). Returns the gate's id, or
 * -1 (invalid stream, too many gates since the last reset). No host code runs
 * on the engine thread, so a caller holding a lock (a Python GIL) while it
 * synchronizes cannot deadlock with the gate. */
EXPORT int fakecuda_hold(void* stream, unsigned long long timeout_us) {
  op* o = calloc(1, sizeof *o);
  if (!o) return -1;
  o->type = OP_GATE;
  o->deadline_ns = now_ns() + (timeout_us ? timeout_us : 10000000ull) * 1000ull;
  pthread_mutex_lock(&g_mu);
  int err, id = -1;
  fc_stream* s = resolve_stream(stream, &err);
  if (s && g_ngates < MAX_GATES) {
    o->gate = id = g_ngates++;
    g_gate_open[id] = 0;
    if (!enqueue(s, o)) id = -1;
  }
  pthread_mutex_unlock(&g_mu);
  if (id < 0) free(o);
  return id;
}

EXPORT void fakecuda_release(int id) {
  pthread_mutex_lock(&g_mu);
  if (id >= 0 && id < g_ngates) g_gate_open[id] = 1;
  pthread_cond_broadcast(&g_cv);
  pthread_mutex_unlock(&g_mu);
}

EXPORT void fakecuda_set_strict(int on) {
  pthread_mutex_lock(&g_mu);
  g_strict = on != 0;
  pthread_mutex_unlock(&g_mu);
}

EXPORT void fakecuda_set_fork_check(int on) {
  pthread_mutex_lock(&g_mu);
  STORE(g_fork_check, on != 0);
  pthread_mutex_unlock(&g_mu);
}

EXPORT void fakecuda_set_device_count(int n) {
  pthread_mutex_lock(&g_mu);
  STORE(g_device_count, n < 0 ? 0 : n);
  pthread_mutex_unlock(&g_mu);
}

EXPORT void fakecuda_set_pageable_sync(int on) {
  pthread_mutex_lock(&g_mu);
  g_pageable_sync = on != 0;
  pthread_mutex_unlock(&g_mu);
}

/* A counter by name: a CUDA function's name gives its calls since reset;
 * otherwise one of the names below; -1 for an unknown name. */
EXPORT long long fakecuda_stat(const char* name) {
  if (!name) return -1;
  int f = fn_index(name);
  pthread_mutex_lock(&g_mu);
  long long v = -1;
  if (f >= 0) v = g_calls[f];
#define STAT(n, expr) else if (strcmp(name, n) == 0) v = (expr);
  STAT("bytes_copied", g_bytes)
  STAT("copies", g_copies)
  STAT("fills", g_fills)
  STAT("host_ops", g_host_ops)
  STAT("pageable_snapshots", g_snapshots)
  STAT("pending_ops", g_pending)
  STAT("max_pending_ops", g_max_pending)
  STAT("live_pinned", g_live_pinned)
  STAT("live_pinned_bytes", g_live_pinned_bytes)
  STAT("live_registered", g_live_registered)
  STAT("live_device", g_live_device)
  STAT("live_device_bytes", g_live_device_bytes)
  STAT("live_events", g_live_events)
  STAT("live_streams", g_live_streams)
  STAT("async_errors", g_async_errors)
  STAT("injected_failures", g_injected)
  STAT("sticky_error", g_sticky)
  STAT("pid", g_pid)
#undef STAT
  else if (strncmp(name, "null_stream_uses_dev", 20) == 0 && name[20] >= '0' && name[20] < '0' + MAX_NULL_DEVICES &&
           name[21] == 0)
    v = g_null_uses[name[20] - '0'];
  pthread_mutex_unlock(&g_mu);
  return v;
}
