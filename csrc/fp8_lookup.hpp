// Byte codes through a 256-entry table, many at a time (fp8.cpp's hot loop).
//
// A table of 256 entries of 2 or 4 bytes does not fit a SIMD register, but
// each of its byte planes (byte p of every entry: 256 bytes) fits four
// 64-byte registers, and AVX-512 VBMI's vpermi2b looks 64 bytes up in a
// 128-byte table in one instruction: two lookups and a blend on the code's
// top bit give one plane for 64 codes, and byte interleaves put the planes
// back together. The planes are split out of the table once per call (a
// block column of a band: its rows reuse them). Chosen at run time (the wheel is built for baseline x86-64);
// elsewhere the portable scalar loop in fp8.cpp runs. Either way the table's
// entries are copied, never computed here: the results are the same bits.
#pragma once

#include <cstdint>

namespace mapoffload {

// The SIMD lookup this CPU runs: "avx512vbmi", or "" (none: fp8.cpp's scalar loop).
const char* fp8_lookup_isa();

// For r < nrows, k < n: out entry [r*stride + k] = table[codes[r*stride + k]],
// for a table of 256 entries of `bytes` (2 or 4) bytes. Returns false, having
// done nothing, where fp8_lookup_isa() is "".
bool lookup_table(const void* table, unsigned bytes, const uint8_t* codes, void* out, uint64_t nrows, uint64_t n,
                  uint64_t stride);

}  // namespace mapoffload
