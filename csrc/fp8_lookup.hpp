// Byte codes through a 256-entry table, many at a time (fp8.cpp's hot loop).
//
// A table of 256 entries of 2 or 4 bytes does not fit a SIMD register, but
// each of its byte planes (byte p of every entry: 256 bytes) fits four
// 64-byte registers, and AVX-512 VBMI's vpermi2b looks 64 bytes up in a
// 128-byte table in one instruction: two lookups and a blend on the code's
// top bit give one plane for 64 codes, and byte interleaves put the planes
// back together. The planes are split out of each table once per call (the
// rows of a band reuse them); rows are walked in order, so that reads and
// writes stay sequential (a walk down block columns defeats the hardware
// prefetcher, and the codes come cold from DRAM, once per forward). Chosen at
// run time (the wheel is built for baseline x86-64); elsewhere the portable
// scalar loop in fp8.cpp runs. Either way the table's entries are copied,
// never computed here: the results are the same bits.
#pragma once

#include <cstdint>

namespace mapoffload {

// The SIMD lookup this CPU runs: "avx512vbmi", or "" (none: fp8.cpp's scalar loop).
const char* fp8_lookup_isa();

// For r < nrows, t < ntables, k < bn, i = r*stride + t*bn + k:
// out[i] = table t's entry codes[i]. `tables` holds ntables tables of 256
// entries of `bytes` (2 or 4) bytes each, one after the other; they are
// rewritten in place (into their byte planes). Returns false, having done
// nothing, where fp8_lookup_isa() is "".
bool lookup_rows(void* tables, unsigned bytes, uint64_t ntables, const uint8_t* codes, void* out, uint64_t nrows,
                 uint64_t bn, uint64_t stride);

}  // namespace mapoffload
