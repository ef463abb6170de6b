// Fused FP8 dequantization (fp8.hpp). Compiled with -ffp-contract=off and
// without fast-math (CMakeLists.txt): the product must be one IEEE float32
// multiply, rounded as torch's `codes.float() * scale` is.
#include "fp8.hpp"

#include <signal.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <vector>

#include "copy_job.hpp"  // MappingFault, mapping_fault
#include "fault_guard.hpp"
#include "fp8_lookup.hpp"

#if defined(__FAST_MATH__)
#error "csrc/fp8.cpp must not be built with -ffast-math: its products must be IEEE float32 multiplies"
#endif

namespace mapoffload {

namespace {

// A table of 256 finished outputs costs 256 multiplies and roundings: it is
// used when at least this many elements share its scale (4x its size), else
// each element is multiplied and rounded where it is.
constexpr uint64_t kTableMinElements = 1024;
// Tables of one band are built a group of scale columns at a time, so that
// the group's tables stay in L1 (32 KiB).
constexpr size_t kTableGroupBytes = 32 * 1024;
// Elements a thread must have to be worth starting: starting one and waking
// an idle core costs tens of us (more in a VM), and its share of the output
// lands in the other core's cache. Measured on 2 vCPUs (fp8_dequant.py): a
// 1024 x 1024 weight (~140 us with the SIMD lookup) took longer on two
// threads than on one, a 3584 x 1024 one less. The SIMD lookup does ~7
// elements a ns, the portable loop ~2.
constexpr uint64_t kMinElementsPerThread = 128 * 1024;
constexpr uint64_t kMinElementsPerSimdThread = 1024 * 1024;
constexpr unsigned kMaxThreads = 64;

float f32_of(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

struct Lut {
  std::array<float, 256> value;
};

const Lut& lut(Fp8Format format) {
  static const Lut tables[2] = {
      [] {
        Lut t;
        for (unsigned c = 0; c < 256; ++c) t.value[c] = f32_of(fp8_to_f32_bits(static_cast<uint8_t>(c), Fp8Format::e4m3fn));
        return t;
      }(),
      [] {
        Lut t;
        for (unsigned c = 0; c < 256; ++c) t.value[c] = f32_of(fp8_to_f32_bits(static_cast<uint8_t>(c), Fp8Format::e5m2));
        return t;
      }(),
  };
  return tables[format == Fp8Format::e4m3fn ? 0 : 1];
}

// The roundings, as functors the kernel is instantiated with.
struct ToBf16 {
  uint16_t nan;
  uint16_t operator()(float f) const { return f32_to_bf16_bits(bits_of(f), nan); }
};
struct ToF16 {
  uint16_t operator()(float f) const { return f32_to_f16_bits(bits_of(f)); }
};
struct ToF32 {
  float operator()(float f) const { return f; }
};

// A piece of the work: rows [r0, r1) of the lead*rows rows.
struct Chunk {
  const Fp8Job* job = nullptr;
  uint64_t r0 = 0, r1 = 0;
  void* tables = nullptr;  // kTableGroupBytes of scratch, the running thread's own (64-byte aligned)
  bool ok = true;
  uint64_t fault = 0;
  // The SIMD lookup refused its tables (it returns false having written
  // nothing): the rows from `r0` on were not written. The job fails with an
  // error rather than hand back memory the kernel never filled.
  bool lookup_refused = false;
};

template <typename T, typename Convert>
void dequantize_rows(Chunk& ch, const Convert& convert) {
  const Fp8Job& j = *ch.job;
  const float* value = lut(j.format).value.data();
  const uint8_t* codes = reinterpret_cast<const uint8_t*>(j.codes);
  const float* scale = reinterpret_cast<const float*>(j.scale);
  T* out = reinterpret_cast<T*>(j.out);
  unsigned char* tables = static_cast<unsigned char*>(ch.tables);
  const uint64_t bm = j.rows / j.srows, bn = j.cols / j.scols;
  constexpr uint64_t kTable = 256 * sizeof(T);
  const uint64_t group = kTableGroupBytes / kTable;
  const bool simd = j.simd && fp8_lookup_isa()[0] != '\0';

  for (uint64_t r = ch.r0; r < ch.r1;) {
    // The rows of one band (one row of the scale grid) in this chunk.
    const uint64_t e = r / j.rows, sr = (r % j.rows) / bm;
    const uint64_t band_end = std::min(ch.r1, e * j.rows + (sr + 1) * bm);
    const float* srow = scale + ((j.scale_lead == 1 ? 0 : e) * j.srows + sr) * j.scols;
    if ((band_end - r) * bn >= kTableMinElements) {
      for (uint64_t g0 = 0; g0 < j.scols; g0 += group) {
        const uint64_t g1 = std::min(j.scols, g0 + group);
        for (uint64_t sc = g0; sc < g1; ++sc) {
          // The outputs of all 256 codes for this block's scale.
          const float s = srow[sc];
          T* t = reinterpret_cast<T*>(tables + (sc - g0) * kTable);
          for (unsigned c = 0; c < 256; ++c) t[c] = convert(value[c] * s);
        }
        if (simd) {
          if (!lookup_rows(tables, sizeof(T), g1 - g0, codes + r * j.cols + g0 * bn, out + r * j.cols + g0 * bn,
                           band_end - r, bn, j.cols)) {
            ch.lookup_refused = true;
            return;
          }
          continue;
        }
        for (uint64_t rr = r; rr < band_end; ++rr) {
          const uint8_t* crow = codes + rr * j.cols;
          T* orow = out + rr * j.cols;
          for (uint64_t sc = g0; sc < g1; ++sc) {
            const T* __restrict t = reinterpret_cast<const T*>(tables + (sc - g0) * kTable);
            const uint8_t* __restrict c = crow + sc * bn;
            T* __restrict o = orow + sc * bn;
            for (uint64_t k = 0; k < bn; ++k) o[k] = t[c[k]];
          }
        }
      }
    } else {
      for (uint64_t rr = r; rr < band_end; ++rr) {
        const uint8_t* crow = codes + rr * j.cols;
        T* orow = out + rr * j.cols;
        for (uint64_t sc = 0; sc < j.scols; ++sc) {
          const float s = srow[sc];
          const uint8_t* __restrict c = crow + sc * bn;
          T* __restrict o = orow + sc * bn;
          for (uint64_t k = 0; k < bn; ++k) o[k] = convert(value[c[k]] * s);
        }
      }
    }
    r = band_end;
  }
}

void run_chunk(void* ctx) {
  Chunk& ch = *static_cast<Chunk*>(ctx);
  switch (ch.job->out_dtype) {
    case Fp8Out::bfloat16:
      dequantize_rows<uint16_t>(ch, ToBf16{ch.job->bf16_nan});
      break;
    case Fp8Out::float16:
      dequantize_rows<uint16_t>(ch, ToF16{});
      break;
    case Fp8Out::float32:
      dequantize_rows<float>(ch, ToF32{});
      break;
  }
}

// The bytes a fault may come from: the codes and the scales (mapped views,
// most often). One range for the guard: from the lower to the end of the
// higher.
struct ReadRange {
  uint64_t lo, hi;
};

ReadRange codes_range(const Fp8Job& j) { return {j.codes, j.codes + j.lead * j.rows * j.cols}; }
ReadRange scale_range(const Fp8Job& j) { return {j.scale, j.scale + j.scale_lead * j.srows * j.scols * 4}; }

void guarded_chunk(Chunk& ch) {
  const ReadRange c = codes_range(*ch.job), s = scale_range(*ch.job);
  const uint64_t lo = std::min(c.lo, s.lo), hi = std::max(c.hi, s.hi);
  ch.ok = guarded_call(reinterpret_cast<const void*>(lo), hi - lo, &run_chunk, &ch, &ch.fault);
}

bool overlap(ReadRange a, ReadRange b) { return a.lo < b.hi && b.lo < a.hi; }

size_t out_size(Fp8Out d) { return d == Fp8Out::float32 ? 4 : 2; }

}  // namespace

Fp8Format parse_fp8_format(const std::string& name) {
  if (name == "e4m3fn") return Fp8Format::e4m3fn;
  if (name == "e5m2") return Fp8Format::e5m2;
  throw std::invalid_argument("fp8 format must be 'e4m3fn' or 'e5m2', not '" + name + "'");
}

Fp8Out parse_fp8_out(const std::string& name) {
  if (name == "bfloat16") return Fp8Out::bfloat16;
  if (name == "float16") return Fp8Out::float16;
  if (name == "float32") return Fp8Out::float32;
  throw std::invalid_argument("output dtype must be 'bfloat16', 'float16' or 'float32', not '" + name + "'");
}

uint32_t fp8_to_f32_bits(uint8_t code, Fp8Format format) {
  // e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits, no infinity, S.1111.111
  // is NaN. e5m2: IEEE-like, 5 exponent bits (bias 15), 2 mantissa bits,
  // exponent 31 is infinity (mantissa 0) or NaN.
  const bool fn = format == Fp8Format::e4m3fn;
  const int ebits = fn ? 4 : 5, mbits = fn ? 3 : 2, bias = fn ? 7 : 15;
  const uint32_t sign = static_cast<uint32_t>(code >> 7) << 31;
  const uint32_t emax = (1u << ebits) - 1, mmask = (1u << mbits) - 1;
  const uint32_t e = (code >> mbits) & emax, m = code & mmask;
  if (e == emax && (fn ? m == mmask : true)) {
    if (!fn && m == 0) return sign | 0x7F800000u;
    // NaN: widened as IEEE conversions widen (sign and payload kept, quiet).
    return sign | 0x7FC00000u | (m << (23 - mbits));
  }
  if (e == 0) {
    if (m == 0) return sign;  // +-0
    // Subnormal: m * 2^(1 - bias - mbits), a normal float32 once the
    // leading one is moved to bit mbits.
    uint32_t mm = m;
    int shift = 0;
    while (!(mm & (1u << mbits))) {
      mm <<= 1;
      ++shift;
    }
    const int exp = 1 - bias - shift;
    return sign | (static_cast<uint32_t>(exp + 127) << 23) | ((mm & mmask) << (23 - mbits));
  }
  return sign | (static_cast<uint32_t>(static_cast<int>(e) - bias + 127) << 23) | (m << (23 - mbits));
}

uint16_t f32_to_bf16_bits(uint32_t u, uint16_t nan) {
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return nan;
  // Round to nearest even on the 16 dropped bits; a carry into the exponent
  // is right (up to infinity included), as c10::BFloat16 rounds.
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

uint16_t f32_to_f16_bits(uint32_t u) {
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u | static_cast<uint16_t>((a >> 13) & 0x3FFu);  // NaN
  if (a >= 0x47800000u) return sign | 0x7C00u;  // >= 65536 (and inf): infinity
  if (a >= 0x38800000u) {
    // A normal half (>= 2^-14): rebias the exponent (127 -> 15) and round the
    // 13 dropped bits to nearest even; a carry may reach the exponent, from
    // 65520 up to infinity (0x7C00), as it should.
    const uint32_t r = a - (112u << 23);
    return sign | static_cast<uint16_t>((r + 0xFFFu + ((r >> 13) & 1u)) >> 13);
  }
  // A half subnormal (units of 2^-24) or zero: the value is
  // m * 2^(e - 150) = m * 2^-24 / 2^(126 - e), m with its implicit one.
  const uint32_t e = a >> 23;
  if (e < 102) return sign;  // below 2^-25: rounds to zero (2^-25 itself is a tie to even: 0)
  const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126 - e;  // 14..24
  const uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
  const uint32_t h = q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
  return sign | static_cast<uint16_t>(h);  // h == 0x400 is the smallest normal, rightly
}

void check_fp8_job(const Fp8Job& j) {
  if (j.codes == 0 || j.scale == 0 || j.out == 0)
    throw std::invalid_argument("codes, scale and out must be addresses of memory, not 0");
  if (j.lead == 0 || j.rows == 0 || j.cols == 0 || j.srows == 0 || j.scols == 0 || j.scale_lead == 0)
    throw std::invalid_argument("sizes must be positive: lead " + std::to_string(j.lead) + ", rows " +
                                std::to_string(j.rows) + ", cols " + std::to_string(j.cols) + ", scale_lead " +
                                std::to_string(j.scale_lead) + ", srows " + std::to_string(j.srows) + ", scols " +
                                std::to_string(j.scols));
  if (j.rows % j.srows || j.cols % j.scols)
    throw std::invalid_argument("weight shape (" + std::to_string(j.rows) + ", " + std::to_string(j.cols) +
                                ") is not divisible by its scale grid (" + std::to_string(j.srows) + ", " +
                                std::to_string(j.scols) + ")");
  if (j.scale_lead != 1 && j.scale_lead != j.lead)
    throw std::invalid_argument("scale_lead must be 1 or lead (" + std::to_string(j.lead) + "), not " +
                                std::to_string(j.scale_lead));
  uint64_t n = 0, sn = 0, bytes = 0, sbytes = 0;
  if (__builtin_mul_overflow(j.lead, j.rows, &n) || __builtin_mul_overflow(n, j.cols, &n) ||
      __builtin_mul_overflow(n, uint64_t{4}, &bytes) || __builtin_add_overflow(j.codes, n, &bytes) ||
      __builtin_add_overflow(j.out, n * out_size(j.out_dtype), &bytes) ||
      __builtin_mul_overflow(j.scale_lead, j.srows, &sn) || __builtin_mul_overflow(sn, j.scols, &sn) ||
      __builtin_mul_overflow(sn, uint64_t{4}, &sbytes) || __builtin_add_overflow(j.scale, sbytes, &sbytes))
    throw std::invalid_argument("sizes overflow the address space");
  if (j.scale % alignof(float))
    throw std::invalid_argument("scale must be float32-aligned (address % 4 == 0)");
  if (j.out % out_size(j.out_dtype))
    throw std::invalid_argument("out must be aligned to its element size (" + std::to_string(out_size(j.out_dtype)) +
                                " bytes)");
  const ReadRange o{j.out, j.out + n * out_size(j.out_dtype)};
  if (overlap(o, codes_range(j)) || overlap(o, scale_range(j)))
    throw std::invalid_argument("out overlaps the codes or the scales");
}

unsigned fp8_job_threads(const Fp8Job& j) {
  // The count is the caller's (mapoffload/fp8.py: MAPOFFLOAD_FP8_THREADS, else torch.get_num_threads()),
  // honoured up to kMaxThreads; no default of its own here.
  uint64_t t = std::max(1u, j.threads);
  t = std::min<uint64_t>({t, kMaxThreads, j.lead * j.rows});
  const uint64_t n = j.lead * j.rows * j.cols;
  const bool simd = j.simd && fp8_lookup_isa()[0] != '\0';
  t = std::min<uint64_t>(t, std::max<uint64_t>(1, n / (simd ? kMinElementsPerSimdThread : kMinElementsPerThread)));
  return static_cast<unsigned>(std::max<uint64_t>(1, t));
}

namespace {

// The rows are handed out in pieces of about this many elements, to whichever
// thread asks first: a helper that starts late (its core busy: torch's
// OpenMP workers spin there for a while after each parallel region) takes
// fewer or none, and the caller never waits for one that has not started.
constexpr uint64_t kPieceElements = 256 * 1024;

// What the caller and its helpers share. Helpers are detached and hold it
// (shared_ptr) until they return; they touch the job's memory only while they
// hold a piece, and the caller returns only when every piece is done.
struct Team {
  Fp8Job job;
  uint64_t total_rows = 0, piece_rows = 0, pieces = 0;
  std::atomic<uint64_t> next{0};
  std::atomic<bool> stop{false};  // a fault: the pieces left are skipped
  std::mutex mu;
  std::condition_variable all_done;
  uint64_t done = 0;       // under mu
  uint64_t fault = 0;      // under mu: the first faulting address, 0 if none
  bool faulted = false;    // under mu
  bool refused = false;    // under mu: a piece's SIMD lookup refused its tables

  void work(void* tables) {
    for (;;) {
      const uint64_t p = next.fetch_add(1, std::memory_order_relaxed);
      if (p >= pieces) return;
      Chunk ch;
      ch.job = &job;
      ch.r0 = p * piece_rows;
      ch.r1 = std::min(total_rows, ch.r0 + piece_rows);
      ch.tables = tables;
      if (!stop.load(std::memory_order_relaxed)) guarded_chunk(ch);
      std::lock_guard<std::mutex> lock(mu);
      if (!ch.ok && !faulted) {
        faulted = true;
        fault = ch.fault;
        stop.store(true, std::memory_order_relaxed);
      }
      if (ch.ok && ch.lookup_refused) {
        refused = true;
        stop.store(true, std::memory_order_relaxed);
      }
      if (++done == pieces) all_done.notify_all();
    }
  }
};

}  // namespace

void dequantize_fp8(const Fp8Job& j) {
  install_fault_guard();
  lut(j.format);  // built before any helper starts
  const unsigned threads = fp8_job_threads(j);
  auto team = std::make_shared<Team>();
  team->job = j;
  team->total_rows = j.lead * j.rows;
  if (threads == 1) {
    team->piece_rows = team->total_rows;
  } else {
    // Whole bands where a piece holds several: each band's tables built once.
    const uint64_t bm = j.rows / j.srows;
    uint64_t rows = std::max<uint64_t>(1, kPieceElements / j.cols);
    if (rows >= bm) rows -= rows % bm;
    team->piece_rows = rows;
  }
  team->pieces = (team->total_rows + team->piece_rows - 1) / team->piece_rows;
  for (uint64_t t = 1; t < threads && t < team->pieces; ++t) {
    try {
      std::thread([team] {
        // Asynchronous signals (Ctrl-C) go to the threads that handle them;
        // the synchronous ones must stay deliverable (a blocked SIGBUS from a
        // fault kills the process instead of reaching the guard).
        sigset_t mask;
        sigfillset(&mask);
        for (int sig : {SIGBUS, SIGSEGV, SIGFPE, SIGILL}) sigdelset(&mask, sig);
        pthread_sigmask(SIG_BLOCK, &mask, nullptr);
        alignas(64) unsigned char tables[kTableGroupBytes];
        team->work(tables);
      }).detach();
    } catch (const std::system_error&) {
      break;  // a thread could not be started: the ones there are do the work
    }
  }
  {
    alignas(64) unsigned char tables[kTableGroupBytes];
    team->work(tables);
  }
  std::unique_lock<std::mutex> lock(team->mu);
  team->all_done.wait(lock, [&] { return team->done == team->pieces; });
  if (team->faulted) {
    const ReadRange c = codes_range(j), s = scale_range(j);
    const ReadRange in = (team->fault >= s.lo && team->fault < s.hi) ? s : c;
    const uint64_t fault = team->fault;
    lock.unlock();
    throw mapping_fault(in.lo, in.hi - in.lo, fault);
  }
  if (team->refused)
    throw std::runtime_error(std::string("dequantize_fp8: the ") + fp8_lookup_isa() +
                             " lookup refused tables of " + std::to_string(out_size(j.out_dtype)) +
                             "-byte entries; the output was not written (pass simd=False for the portable loop)");
}

}  // namespace mapoffload
