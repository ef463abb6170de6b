// Turn a SIGBUS while reading a mapping (its file was truncated under it)
// into an error instead of the death of the process.
//
// The kernel sends SIGBUS to the thread that touches a page of a file mapping
// beyond the file's end (mmap(2), "SIGBUS"), with a positive si_code
// (BUS_ADRERR; BUS_OBJERR for an I/O error). A guarded read arms a per-thread
// jump buffer; the process-wide handler jumps back only for such a fault, on
// the faulting thread, inside the guarded range. Every other SIGBUS (a fault
// outside a guarded read, one sent with kill/raise/sigqueue) is forwarded
// exactly as if the guard were not installed: the previous disposition is put
// back and the fault re-executes (or the sent signal is queued again) to it.
//
// Other libraries install SIGBUS handlers too (Python's faulthandler does on
// enable() and restores its predecessor on disable()). The guard re-checks
// that it is first in line before each guarded batch and re-installs itself
// in front of whatever is there, so a later installation cannot defeat it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mapoffload {

// Makes sure the SIGBUS handler is installed and first in line (cheap: one
// sigaction query; call it before a batch of guarded reads). Thread-safe.
void install_fault_guard();

// memcpy(dst, src, n) where a fault while reading [src, src+n) returns false
// and stores the faulting address. Writes to dst are never guarded.
bool guarded_memcpy(void* dst, const void* src, size_t n, uint64_t* fault_addr);

// Reads one byte of every `stride` bytes of [src, src+n) (the first included):
// faults a mapping's pages in where MADV_POPULATE_READ does not exist. A read
// never breaks a private mapping's copy-on-write. A fault (SIGBUS) returns
// false and stores the faulting address. Call install_fault_guard() first.
bool guarded_touch(const void* src, size_t n, size_t stride, uint64_t* fault_addr);

// fn(ctx), where a fault while reading [lo, lo+n) leaves fn and returns false
// with the faulting address stored. A fault leaves fn by siglongjmp: fn must
// own nothing that needs a destructor or a lock. Call install_fault_guard()
// first.
bool guarded_call(const void* lo, size_t n, void (*fn)(void*), void* ctx, uint64_t* fault_addr);

}  // namespace mapoffload
