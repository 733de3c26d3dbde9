/* The multiply-add peak of one core: independent chains of vector multiply-adds that
 * never wait on memory or on each other.
 *
 * `peak_f32(iters)` runs `iters` rounds of CHAINS float32 multiply-adds on full
 * vectors (16 lanes with AVX-512, 8 with AVX2 and FMA; elsewhere, as on arm64, plain
 * float multiply-adds, which the compiler may pack as it likes), `peak_bf16(iters)` the same
 * with bfloat16 pair dot products (VDPBF16PS: two multiply-adds a lane) where the CPU
 * has AVX512_BF16, else with float32 multiply-adds as a kernel without it computes
 * bfloat16. Each returns a sum of its chains, so that none can be left out;
 * `chains()`, `f32_lanes()` and `bf16_flops_per_lane()` say how many chains a round
 * runs and how many flops its instruction does per chain. Built by cpu_peers.py.
 */
#include <stdint.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#define CHAINS 12

#if defined(__AVX512F__)
typedef __m512 vec;
#define LANES 16
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
static float first_lane(vec v) { return _mm512_cvtss_f32(v); }
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vec;
#define LANES 8
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
static float first_lane(vec v) { return _mm256_cvtss_f32(v); }
#else
typedef float vec;
#define LANES 1
#define SET1(x) (x)
#define FMA __builtin_fmaf
static float first_lane(vec v) { return v; }
#endif

/* A function `name(iters)`: CHAINS chains of `type`, chain c starting at c in every
 * lane, each round `acc = step(acc)`; the sum of the chains' first lanes. */
#define CHAIN_LOOP(name, type, from_float, step, first)                  \
  double name(int64_t iters) {                                            \
    type acc[CHAINS];                                                     \
    for (int c = 0; c < CHAINS; ++c) acc[c] = from_float((float)c);       \
    for (int64_t i = 0; i < iters; ++i) {                                 \
      _Pragma("GCC unroll 12") for (int c = 0; c < CHAINS; ++c) acc[c] = step(acc[c]); \
    }                                                                     \
    double sum = 0;                                                       \
    for (int c = 0; c < CHAINS; ++c) sum += first(acc[c]);                \
    return sum;                                                           \
  }

int f32_lanes(void) { return LANES; }
int chains(void) { return CHAINS; }

#define F32_STEP(acc) FMA(acc, SET1(0.999999f), SET1(1e-7f))
CHAIN_LOOP(peak_f32, vec, SET1, F32_STEP, first_lane)

#if defined(__AVX512BF16__)
int bf16_flops_per_lane(void) { return 4 * 16; } /* two multiply-adds on each of 16 lanes */

/* 1.0 and 2^-24 in every bfloat16 of the pairs. */
#define BF16_STEP(acc) \
  _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi16(0x3f80), (__m512bh)_mm512_set1_epi16(0x3380))
CHAIN_LOOP(peak_bf16, __m512, _mm512_set1_ps, BF16_STEP, _mm512_cvtss_f32)
#else
int bf16_flops_per_lane(void) { return 2 * LANES; }

double peak_bf16(int64_t iters) { return peak_f32(iters); }
#endif
