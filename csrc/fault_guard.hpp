// Turn a SIGBUS while reading a mapping (its file was truncated under it)
// into an error instead of the death of the process.
//
// The kernel sends SIGBUS to the thread that touches a page of a file mapping
// beyond the file's end (mmap(2), "SIGBUS"). A guarded read arms a per-thread
// jump buffer; the process-wide handler jumps back when the faulting thread is
// inside a guarded read of that address range, and otherwise chains to the
// handler that was installed before (or the default action).
#pragma once

#include <cstddef>
#include <cstdint>

namespace mapoffload {

// Installs the SIGBUS handler once (idempotent, thread-safe).
void install_fault_guard();

// memcpy(dst, src, n) where a SIGBUS while reading [src, src+n) returns false
// and stores the faulting address. Writes to dst are never guarded.
bool guarded_memcpy(void* dst, const void* src, size_t n, uint64_t* fault_addr);

}  // namespace mapoffload
