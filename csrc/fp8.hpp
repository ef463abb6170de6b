// Fused dequantization of fine-grained FP8 weights on the CPU.
//
// Fine-grained FP8 checkpoints (DeepSeek-V3/R1, Qwen3 -FP8) store a weight as
// float8 codes [lead..., rows, cols] and a float32 scale per block of the
// grid [lead..., srows, scols] (block bm = rows/srows, bn = cols/scols;
// per-tensor and per-channel scales are the same rule with one block or one
// column of blocks). transformers dequantizes with
//   (codes.to(float32) * scale_broadcast_per_block).to(dtype)
// and so does mapoffload.fp8's torch path. This kernel computes the same bits
// in one pass and without float32 temporaries:
//   out[i,j] = round_to(dtype, value(code[i,j]) * scale[i/bm, j/bn])
// value() is the exact float32 value of each of the 256 codes (a table built
// from the format's definition: subnormals, signed zeros, NaN codes, e5m2's
// infinities), the product one IEEE float32 multiply (fp8.cpp is compiled
// without contraction or fast-math), the rounding torch's: round to nearest
// even, NaN as torch's CPU kernels write it (see Fp8Job::bf16_nan).
//
// Because each output is a function of (code, the block's scale) only, a
// block row whose scale is used for many elements goes through a 256-entry
// table of finished outputs for that scale (built with the same multiply and
// rounding): the hot loop is a byte load, a table load and a store.
#pragma once

#include <cstdint>
#include <string>

namespace mapoffload {

enum class Fp8Format : uint8_t { e4m3fn, e5m2 };
enum class Fp8Out : uint8_t { bfloat16, float16, float32 };

// "e4m3fn" | "e5m2", "bfloat16" | "float16" | "float32"; anything else throws
// std::invalid_argument.
Fp8Format parse_fp8_format(const std::string& name);
Fp8Out parse_fp8_out(const std::string& name);

// The float32 bit pattern of one code: the exact value; NaN codes widen as
// IEEE conversions do (sign and payload kept, quiet bit set), as torch's.
uint32_t fp8_to_f32_bits(uint8_t code, Fp8Format format);

// Round-to-nearest-even float32 -> bfloat16 / float16 bits, as torch rounds.
// bfloat16: every NaN becomes `nan` (torch's vectorized CPU kernels write
// 0xFFFF, its scalar c10::BFloat16 0x7FC0: the caller says which).
// float16: subnormals, overflow to infinity, NaN keeps its sign and the top
// of its payload with the quiet bit set (what F16C's vcvtps2ph does).
uint16_t f32_to_bf16_bits(uint32_t f, uint16_t nan);
uint16_t f32_to_f16_bits(uint32_t f);

struct Fp8Job {
  uint64_t codes = 0;  // address of lead*rows*cols code bytes, row-major
  uint64_t scale = 0;  // address of scale_lead*srows*scols float32, row-major
  uint64_t out = 0;    // address of lead*rows*cols outputs, row-major
  uint64_t lead = 1, rows = 0, cols = 0;
  uint64_t scale_lead = 1;  // 1: one grid for every lead index; or lead
  uint64_t srows = 0, scols = 0;
  Fp8Format format = Fp8Format::e4m3fn;
  Fp8Out out_dtype = Fp8Out::bfloat16;
  uint16_t bf16_nan = 0x7FC0;
  unsigned threads = 0;  // 0: one. The default (MAPOFFLOAD_FP8_THREADS, else torch's) is mapoffload/fp8.py's alone
  bool simd = true;      // false: the portable loop even where fp8_lookup.hpp has a SIMD one (tests)
};

// Throws std::invalid_argument naming what is wrong: a null address, a zero
// size, a grid that does not divide the shape, a scale lead that is neither 1
// nor lead, sizes whose bytes overflow, a misaligned scale or output, an
// output that overlaps the codes or the scales.
void check_fp8_job(const Fp8Job& job);

// Threads the job runs on: `threads` (0: one), at most 64 and
// the rows, and one per 128 Ki elements at most (1 Mi with the SIMD
// lookup): one below 256 Ki (2 Mi).
unsigned fp8_job_threads(const Fp8Job& job);

// Runs a checked job (call check_fp8_job first) on the calling thread and
// fp8_job_threads(job) - 1 helpers, which take pieces of ~256 Ki elements as
// they come (a helper that starts late takes fewer; the caller never waits for
// one that has not started). A SIGBUS while reading the codes or the scales
// (their file was truncated under the mapping) throws MappingFault
// (copy_job.hpp).
void dequantize_fp8(const Fp8Job& job);

}  // namespace mapoffload
