// Page-cache residency of byte spans (mincore(2)) and readahead hints.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace mapoffload {

size_t page_size();
inline uint64_t page_align_down(uint64_t a, uint64_t ps) { return a & ~(ps - 1); }
inline uint64_t page_align_up(uint64_t a, uint64_t ps) { return (a + ps - 1) & ~(ps - 1); }
inline uint64_t bytes_to_pages(uint64_t n, uint64_t ps) { return (n + ps - 1) / ps; }

// Bytes of [addr, addr+nbytes) that lie on pages resident in RAM now.
// Unmapped pages count as not resident. Partial first/last pages count only
// the bytes of the span they hold.
uint64_t resident_bytes(uint64_t addr, uint64_t nbytes);

// madvise(MADV_WILLNEED) over the pages of a span: starts kernel readahead
// for file mappings (a no-op for anonymous memory). Errors are ignored: it is
// a hint, and spans that are not mapped have nothing to read ahead.
void advise_willneed(uint64_t addr, uint64_t nbytes);

// (resident bytes, file size) of a file's pages in the page cache, by mincore
// over a fresh read-only shared mapping (the vmtouch view): nothing is read.
// Throws OsError (maps.hpp) when the file cannot be opened or mapped.
std::pair<uint64_t, uint64_t> file_resident_bytes(const std::string& path);

// True when the page holding addr is resident (one mincore call).
bool page_resident(uint64_t addr);

// madvise(MADV_POPULATE_READ): fault a span's pages in with one call instead
// of one fault per page (Linux 5.14+). Pages are mapped readable only, so a
// private mapping's copy-on-write is not broken. Returns false where the
// kernel lacks it or a page cannot be read (the caller's read then reports it).
bool populate_read(uint64_t addr, uint64_t nbytes);

}  // namespace mapoffload
