// SIMD table lookups of byte codes (fp8_lookup.hpp).
#include "fp8_lookup.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MAPOFFLOAD_FP8_VBMI 1
#include <immintrin.h>
#endif

namespace mapoffload {

#if MAPOFFLOAD_FP8_VBMI

namespace {

#define MAPOFFLOAD_VBMI __attribute__((target("avx512f,avx512bw,avx512vbmi")))

// vpermt2b / vpermt2w indices (bits 0-5 / 0-4 an element, the next bit the
// second operand). Interleave: the bytes (words) of a at even places, of b at
// odd places, from the low halves ([0]) or the high halves ([1]). Split: the
// even ([0]) or odd ([1]) bytes (words) of a, then of b.
struct Indices {
  alignas(64) uint8_t interleave_bytes[2][64];
  alignas(64) uint16_t interleave_words[2][32];
  alignas(64) uint8_t split_bytes[2][64];
  alignas(64) uint16_t split_words[2][32];
  Indices() {
    for (int h = 0; h < 2; ++h) {
      for (int j = 0; j < 64; ++j) {
        interleave_bytes[h][j] = static_cast<uint8_t>((j & 1 ? 64 : 0) + 32 * h + j / 2);
        split_bytes[h][j] = static_cast<uint8_t>(2 * j + h);
      }
      for (int j = 0; j < 32; ++j) {
        interleave_words[h][j] = static_cast<uint16_t>((j & 1 ? 32 : 0) + 16 * h + j / 2);
        split_words[h][j] = static_cast<uint16_t>(2 * j + h);
      }
    }
  }
};
const Indices kIdx;

#define MAPOFFLOAD_IDX(name, h) _mm512_load_si512(kIdx.name[h])

// One byte plane of the table (byte p of its 256 entries) in four registers.
struct Plane {
  __m512i q[4];
};

// The plane's byte for each of 64 codes: codes < 128 from q[0..1], the rest
// from q[2..3] (vpermi2b reads the low 7 bits of each index).
MAPOFFLOAD_VBMI inline __m512i look(const Plane& p, __m512i idx, __mmask64 high) {
  return _mm512_mask_blend_epi8(high, _mm512_permutex2var_epi8(p.q[0], idx, p.q[1]),
                                _mm512_permutex2var_epi8(p.q[2], idx, p.q[3]));
}

// Codes k..k+63 of a row as far as n: the mask of those that exist. Masked
// loads and stores neither touch nor fault on bytes outside the mask.
inline __mmask64 tail_mask(uint64_t left) { return left >= 64 ? ~__mmask64{0} : ((__mmask64{1} << left) - 1); }

// A table of 256 entries of 2 bytes, in place, into its byte planes (low
// bytes, then high bytes). Its 8 registers of 32 entries: the low bytes of 64
// entries are the even bytes of two of them, the high bytes the odd ones.
MAPOFFLOAD_VBMI void split16(unsigned char* table) {
  __m512i t[8];
  for (int i = 0; i < 8; ++i) t[i] = _mm512_loadu_si512(table + 64 * i);
  const __m512i even = MAPOFFLOAD_IDX(split_bytes, 0), odd = MAPOFFLOAD_IDX(split_bytes, 1);
  for (int i = 0; i < 4; ++i) {
    _mm512_storeu_si512(table + 64 * i, _mm512_permutex2var_epi8(t[2 * i], even, t[2 * i + 1]));
    _mm512_storeu_si512(table + 256 + 64 * i, _mm512_permutex2var_epi8(t[2 * i], odd, t[2 * i + 1]));
  }
}

// The same for entries of 4 bytes: 16 registers of 16 entries; their low and
// high 16-bit halves (even and odd words of two registers: 32 entries), then
// the bytes of those (even and odd bytes of two: 64 entries).
MAPOFFLOAD_VBMI void split32(unsigned char* table) {
  __m512i t[16];
  for (int i = 0; i < 16; ++i) t[i] = _mm512_loadu_si512(table + 64 * i);
  const __m512i even_w = MAPOFFLOAD_IDX(split_words, 0), odd_w = MAPOFFLOAD_IDX(split_words, 1);
  const __m512i even_b = MAPOFFLOAD_IDX(split_bytes, 0), odd_b = MAPOFFLOAD_IDX(split_bytes, 1);
  for (int i = 0; i < 4; ++i) {
    __m512i lw[2], hw[2];
    for (int k = 0; k < 2; ++k) {
      const __m512i a = t[4 * i + 2 * k], b = t[4 * i + 2 * k + 1];
      lw[k] = _mm512_permutex2var_epi16(a, even_w, b);
      hw[k] = _mm512_permutex2var_epi16(a, odd_w, b);
    }
    _mm512_storeu_si512(table + 64 * i, _mm512_permutex2var_epi8(lw[0], even_b, lw[1]));
    _mm512_storeu_si512(table + 256 + 64 * i, _mm512_permutex2var_epi8(lw[0], odd_b, lw[1]));
    _mm512_storeu_si512(table + 512 + 64 * i, _mm512_permutex2var_epi8(hw[0], even_b, hw[1]));
    _mm512_storeu_si512(table + 768 + 64 * i, _mm512_permutex2var_epi8(hw[0], odd_b, hw[1]));
  }
}

MAPOFFLOAD_VBMI inline Plane load_plane(const unsigned char* p) {
  return {{_mm512_loadu_si512(p), _mm512_loadu_si512(p + 64), _mm512_loadu_si512(p + 128),
           _mm512_loadu_si512(p + 192)}};
}

// Row by row (sequential reads and writes: the hardware prefetches them), a
// run of bn codes per table; a table's planes come from L1 for each run.
MAPOFFLOAD_VBMI void lookup16(unsigned char* tables, uint64_t ntables, const uint8_t* codes, uint16_t* out,
                              uint64_t nrows, uint64_t bn, uint64_t stride) {
  for (uint64_t t = 0; t < ntables; ++t) split16(tables + 512 * t);
  const __m512i ia = MAPOFFLOAD_IDX(interleave_bytes, 0), ib = MAPOFFLOAD_IDX(interleave_bytes, 1);
  for (uint64_t r = 0; r < nrows; ++r) {
    for (uint64_t t = 0; t < ntables; ++t) {
      const Plane lo = load_plane(tables + 512 * t), hi = load_plane(tables + 512 * t + 256);
      const uint8_t* c = codes + r * stride + t * bn;
      uint16_t* o = out + r * stride + t * bn;
      for (uint64_t k = 0; k < bn; k += 64) {
        const __mmask64 m = tail_mask(bn - k);
        const __m512i idx = _mm512_maskz_loadu_epi8(m, c + k);
        const __mmask64 high = _mm512_movepi8_mask(idx);
        const __m512i l = look(lo, idx, high), h = look(hi, idx, high);
        _mm512_mask_storeu_epi16(o + k, static_cast<__mmask32>(m), _mm512_permutex2var_epi8(l, ia, h));
        _mm512_mask_storeu_epi16(o + k + 32, static_cast<__mmask32>(m >> 32), _mm512_permutex2var_epi8(l, ib, h));
      }
    }
  }
}

MAPOFFLOAD_VBMI void lookup32(unsigned char* tables, uint64_t ntables, const uint8_t* codes, uint32_t* out,
                              uint64_t nrows, uint64_t bn, uint64_t stride) {
  for (uint64_t t = 0; t < ntables; ++t) split32(tables + 1024 * t);
  const __m512i ia = MAPOFFLOAD_IDX(interleave_bytes, 0), ib = MAPOFFLOAD_IDX(interleave_bytes, 1);
  const __m512i wa = MAPOFFLOAD_IDX(interleave_words, 0), wb = MAPOFFLOAD_IDX(interleave_words, 1);
  for (uint64_t r = 0; r < nrows; ++r) {
    for (uint64_t t = 0; t < ntables; ++t) {
      const unsigned char* p = tables + 1024 * t;
      const Plane p0 = load_plane(p), p1 = load_plane(p + 256), p2 = load_plane(p + 512), p3 = load_plane(p + 768);
      const uint8_t* c = codes + r * stride + t * bn;
      uint32_t* o = out + r * stride + t * bn;
      for (uint64_t k = 0; k < bn; k += 64) {
        const __mmask64 m = tail_mask(bn - k);
        const __m512i idx = _mm512_maskz_loadu_epi8(m, c + k);
        const __mmask64 high = _mm512_movepi8_mask(idx);
        const __m512i b0 = look(p0, idx, high), b1 = look(p1, idx, high), b2 = look(p2, idx, high),
                      b3 = look(p3, idx, high);
        // Low and high 16-bit halves of codes 0-31 and 32-63, then the dwords.
        const __m512i l0 = _mm512_permutex2var_epi8(b0, ia, b1), l1 = _mm512_permutex2var_epi8(b0, ib, b1);
        const __m512i h0 = _mm512_permutex2var_epi8(b2, ia, b3), h1 = _mm512_permutex2var_epi8(b2, ib, b3);
        _mm512_mask_storeu_epi32(o + k, static_cast<__mmask16>(m), _mm512_permutex2var_epi16(l0, wa, h0));
        _mm512_mask_storeu_epi32(o + k + 16, static_cast<__mmask16>(m >> 16), _mm512_permutex2var_epi16(l0, wb, h0));
        _mm512_mask_storeu_epi32(o + k + 32, static_cast<__mmask16>(m >> 32), _mm512_permutex2var_epi16(l1, wa, h1));
        _mm512_mask_storeu_epi32(o + k + 48, static_cast<__mmask16>(m >> 48), _mm512_permutex2var_epi16(l1, wb, h1));
      }
    }
  }
}

bool has_vbmi() {
  // libgcc's and compiler-rt's checks include the OS saving the zmm state (XCR0).
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vbmi");
  return yes;
}

}  // namespace

const char* fp8_lookup_isa() { return has_vbmi() ? "avx512vbmi" : ""; }

bool lookup_rows(void* tables, unsigned bytes, uint64_t ntables, const uint8_t* codes, void* out, uint64_t nrows,
                 uint64_t bn, uint64_t stride) {
  if (!has_vbmi()) return false;
  unsigned char* t = static_cast<unsigned char*>(tables);
  if (bytes == 2) {
    lookup16(t, ntables, codes, static_cast<uint16_t*>(out), nrows, bn, stride);
    return true;
  }
  if (bytes == 4) {
    lookup32(t, ntables, codes, static_cast<uint32_t*>(out), nrows, bn, stride);
    return true;
  }
  return false;
}

#else

const char* fp8_lookup_isa() { return ""; }

bool lookup_rows(void*, unsigned, uint64_t, const uint8_t*, void*, uint64_t, uint64_t, uint64_t) {
  return false;
}

#endif

}  // namespace mapoffload
