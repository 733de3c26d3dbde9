// The CPU path's own kernels: decode attention over the paged KV cache reading each
// block in place, RMSNorm (with the residual add before it) and the rotary embedding.
//
// Attention:
// Tasks are sequences (or, when there are too few to share out, single KV heads),
// spread over torch's OpenMP threads. A task loads its query heads once, scores
// every context position against them (each key is read once for its whole group
// of query heads), takes the softmax in float32 and accumulates the values, again
// one read per position. Keys and values are read straight from their cache
// blocks through the block table, slot after slot, so no per-step copy of the
// context is made and each block's memory is swept front to back.
// The headers the kernels use rather than <torch/extension.h>, which brings the whole
// C++ frontend: that header alone took 21 of the build's 37 s of compiling (two
// cores, Zen 4); with these, `cadence build-kernels` runs 41 -> 28 s.
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/silu.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define CADENCE_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CADENCE_AVX2 1
#endif
// The float32 small-batch product runs on either instruction set; the bfloat16 one with
// AVX512_BF16's dot products, or with AVX2 widening each value to float32.
#if defined(CADENCE_AVX512) || defined(CADENCE_AVX2)
#define CADENCE_SMALL_FLOAT 1
#endif
#if defined(__AVX512BF16__) || defined(CADENCE_AVX2)
#define CADENCE_SMALL_BFLOAT16 1
#endif

namespace {

#ifdef CADENCE_AVX512
// 16 bfloat16 values (their bits) as float32 lanes: exact, a shift of each into the high half.
inline __m512 widen_bfloat16(__m256i raw) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
// The first min(n, 16) of 16 lanes (n >= 1).
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1u);
}
#endif

inline float to_float(float x) { return x; }
inline float to_float(double x) { return static_cast<float>(x); }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float to_float(at::Half x) { return static_cast<float>(x); }

// The softmax of s[0, seen) in place, in float32; s[seen, len) weighs nothing.
inline void softmax_row(float* s, int64_t seen, int64_t len) {
  const float peak = *std::max_element(s, s + seen);
  float total = 0.0f;
  for (int64_t p = 0; p < seen; ++p) {
    s[p] = std::exp(s[p] - peak);
    total += s[p];
  }
  const float inverse = 1.0f / total;
  for (int64_t p = 0; p < seen; ++p) s[p] *= inverse;
  std::fill(s + seen, s + len, 0.0f);
}

template <typename scalar_t>
inline void load_row(const scalar_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// Positions one block ahead are prefetched: blocks lie anywhere in the cache, so the
// hardware's stream prefetcher loses its stream at every block boundary.
constexpr int64_t kCacheLine = 64;

// The shapes, strides and data of one decode attention call, and how it is cut into
// tasks: a task is a sequence's KV heads [first, first + heads_per_task), whole
// sequences when there are enough to keep every thread busy, so that each task sweeps
// its blocks' memory front to back (one slot holds every head), else single heads.
template <typename scalar_t>
struct DecodeLayout {
  int64_t num_seqs, num_heads, head_dim, block_size, num_kv_heads, group, table_width;
  const scalar_t *q_ptr, *k_ptr, *v_ptr;
  scalar_t* out_ptr;
  const int32_t *tables, *lens;
  int64_t q_stride_seq, q_stride_head, kv_stride_block, kv_stride_slot, kv_stride_head;
  int64_t heads_per_task, tasks_per_seq, task_bytes;

  DecodeLayout(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
               const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out)
      : num_seqs(query.size(0)), num_heads(query.size(1)), head_dim(query.size(2)),
        block_size(k_cache.size(1)), num_kv_heads(k_cache.size(2)), group(num_heads / num_kv_heads),
        table_width(block_tables.size(1)), q_ptr(query.data_ptr<scalar_t>()), k_ptr(k_cache.data_ptr<scalar_t>()),
        v_ptr(v_cache.data_ptr<scalar_t>()), out_ptr(out.data_ptr<scalar_t>()),
        tables(block_tables.data_ptr<int32_t>()), lens(seq_lens.data_ptr<int32_t>()),
        q_stride_seq(query.stride(0)), q_stride_head(query.stride(1)), kv_stride_block(k_cache.stride(0)),
        kv_stride_slot(k_cache.stride(1)), kv_stride_head(k_cache.stride(2)),
        heads_per_task(num_seqs >= 4 * at::get_num_threads() ? num_kv_heads : 1),
        tasks_per_seq(num_kv_heads / heads_per_task),
        task_bytes(((heads_per_task - 1) * kv_stride_head + head_dim) * sizeof(scalar_t)) {}

  // Whether row `seq` is the row before it one position on: the next query row of the
  // same prompt (the same blocks, a context one longer), whose keys and values the row
  // before has just read, all but the last.
  bool follows(int64_t seq) const {
    if (seq == 0 || lens[seq] != lens[seq - 1] + 1) return false;
    const int64_t blocks = (lens[seq] + block_size - 1) / block_size;
    return std::memcmp(tables + seq * table_width, tables + (seq - 1) * table_width, blocks * sizeof(int32_t)) == 0;
  }

  // Where position `pos` of sequence `seq`, KV head `kv`, lies in a cache (elements).
  int64_t slot_offset(int64_t seq, int64_t kv, int64_t pos) const {
    return static_cast<int64_t>(tables[seq * table_width + pos / block_size]) * kv_stride_block +
           (pos % block_size) * kv_stride_slot + kv * kv_stride_head;
  }
};

template <typename scalar_t>
void decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                      at::Tensor& out) {
  const DecodeLayout<scalar_t> shape(query, k_cache, v_cache, block_tables, seq_lens, out);
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, shape.num_seqs * shape.tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    const int64_t rows = shape.heads_per_task * shape.group;
    std::vector<float> q(rows * shape.head_dim), acc(rows * shape.head_dim), row(shape.head_dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / shape.tasks_per_seq, first_kv = (task % shape.tasks_per_seq) * shape.heads_per_task;
      const int64_t len = shape.lens[seq];
      // Where position `pos` of this task's first KV head lives in a cache.
      auto slot_at = [&](const scalar_t* cache, int64_t pos) { return cache + shape.slot_offset(seq, 0, pos); };
      auto prefetch = [&](const scalar_t* slot) {
        const char* first = reinterpret_cast<const char*>(slot + first_kv * shape.kv_stride_head);
        for (int64_t offset = 0; offset < shape.task_bytes; offset += kCacheLine) __builtin_prefetch(first + offset);
      };
      for (int64_t r = 0; r < rows; ++r) {
        load_row(shape.q_ptr + seq * shape.q_stride_seq + (first_kv * shape.group + r) * shape.q_stride_head, q.data() + r * shape.head_dim,
                 shape.head_dim);
      }
      scores.resize(rows * len);
      for (int64_t pos = 0; pos < len; ++pos) {
        const scalar_t* slot = slot_at(shape.k_ptr, pos);
        if (pos + shape.block_size < len) prefetch(slot_at(shape.k_ptr, pos + shape.block_size));
        for (int64_t h = 0; h < shape.heads_per_task; ++h) {
          load_row(slot + (first_kv + h) * shape.kv_stride_head, row.data(), shape.head_dim);
          for (int64_t g = 0; g < shape.group; ++g) {
            const float* qr = q.data() + (h * shape.group + g) * shape.head_dim;
            float dot = 0.0f;
            for (int64_t d = 0; d < shape.head_dim; ++d) dot += qr[d] * row[d];
            scores[(h * shape.group + g) * len + pos] = dot * fscale;
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) softmax_row(scores.data() + r * len, len, len);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t pos = 0; pos < len; ++pos) {
        const scalar_t* slot = slot_at(shape.v_ptr, pos);
        if (pos + shape.block_size < len) prefetch(slot_at(shape.v_ptr, pos + shape.block_size));
        for (int64_t h = 0; h < shape.heads_per_task; ++h) {
          load_row(slot + (first_kv + h) * shape.kv_stride_head, row.data(), shape.head_dim);
          for (int64_t g = 0; g < shape.group; ++g) {
            const float p = scores[(h * shape.group + g) * len + pos];
            float* a = acc.data() + (h * shape.group + g) * shape.head_dim;
            for (int64_t d = 0; d < shape.head_dim; ++d) a[d] += p * row[d];
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        scalar_t* o = shape.out_ptr + seq * out.stride(0) + (first_kv * shape.group + r) * out.stride(1);
        for (int64_t d = 0; d < shape.head_dim; ++d) o[d] = static_cast<scalar_t>(acc[r * shape.head_dim + d]);
      }
    }
  });
}

#ifdef CADENCE_AVX512
// Decode attention in AVX-512 vectors, for float32, and for bfloat16 with the CPU's
// bfloat16 dot products (AVX512_BF16), at the usual head sizes. The same sweep as
// `decode_attention`, a tile of kTile positions at a time: each tile's keys are scored
// against every query row of the task, sixteen positions' sums reduced together (the
// products of bfloat16 values are exact in float32, so only the order of the sums
// differs from the portable kernel), and the values are accumulated in float32
// registers, up to eight query rows at a time (bfloat16 values with the weights rounded
// to bfloat16, two positions a dot product: `accumulate_pairs`).
constexpr int64_t kTile = 16;
// Tiles a task's prefetches run ahead of its work.
constexpr int64_t kAhead = 2;

// Element j of the result is the sum of the lanes of a[j].
inline __m512 sum_each(const __m512* a) {
  __m512 pairs[8], quads[4];
  for (int k = 0; k < 8; ++k) {
    pairs[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]), _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
  }
  for (int m = 0; m < 4; ++m) {
    quads[m] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * m], pairs[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(pairs[2 * m], pairs[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(3, 1, 3, 1)));
}

// What the kernel needs of an element type, for rows of kVecs float vectors: a query
// row as the vectors its dot products take, its dot product with a key (a vector whose
// lanes sum to it), a value row's c-th float vector, and a float row's store.
template <typename scalar_t, int kVecs>
struct Lanes;

template <int kVecs>
struct Lanes<float, kVecs> {
  static constexpr int kQuery = kVecs;
  using Query = __m512;
  static Query query(const float* src, int c) { return _mm512_loadu_ps(src + 16 * c); }
  static __m512 dot(const Query* q, const float* key) {
    __m512 sum = _mm512_mul_ps(q[0], _mm512_loadu_ps(key));
    for (int c = 1; c < kQuery; ++c) sum = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(key + 16 * c), sum);
    return sum;
  }
  static __m512 value(const float* src, int c) { return _mm512_loadu_ps(src + 16 * c); }
  static void store(float* dst, int c, __m512 x) { _mm512_storeu_ps(dst + 16 * c, x); }
};

#ifdef __AVX512BF16__
template <int kVecs>
struct Lanes<at::BFloat16, kVecs> {
  static constexpr int kQuery = kVecs / 2;  // 32 bfloat16 values a dot-product instruction
  using Query = __m512bh;
  static Query query(const at::BFloat16* src, int c) { return (__m512bh)_mm512_loadu_si512(src + 32 * c); }
  static __m512 dot(const Query* q, const at::BFloat16* key) {
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < kQuery; ++c) sum = _mm512_dpbf16_ps(sum, q[c], (__m512bh)_mm512_loadu_si512(key + 32 * c));
    return sum;
  }
  static __m512 value(const at::BFloat16* src, int c) {
    return widen_bfloat16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 16 * c)));
  }
  static void store(at::BFloat16* dst, int c, __m512 x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * c), (__m256i)_mm512_cvtneps_pbh(x));
  }
};
#endif

// sums[r] (kRows rows of kVecs float vectors, a row every head_dim = 16 * kVecs floats)
// += weights[r * stride + p] * value(p) over positions [begin, end): in registers.
template <typename scalar_t, int kVecs, int kRows>
inline void accumulate(const scalar_t* cache, const int64_t* slots, int64_t head_offset, int64_t begin,
                       int64_t end, const float* weights, int64_t stride, float* sums) {
  __m512 total[kRows][kVecs];
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kVecs; ++c) total[r][c] = _mm512_loadu_ps(sums + r * 16 * kVecs + 16 * c);
  }
  for (int64_t p = begin; p < end; ++p) {
    const scalar_t* value = cache + slots[p] + head_offset;
    __m512 row[kVecs];
    for (int c = 0; c < kVecs; ++c) row[c] = Lanes<scalar_t, kVecs>::value(value, c);
    for (int r = 0; r < kRows; ++r) {
      const __m512 weight = _mm512_set1_ps(weights[r * stride + p]);
      for (int c = 0; c < kVecs; ++c) total[r][c] = _mm512_fmadd_ps(weight, row[c], total[r][c]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kVecs; ++c) _mm512_storeu_ps(sums + r * 16 * kVecs + 16 * c, total[r][c]);
  }
}

#ifdef __AVX512BF16__
// Two positions' 32 bfloat16 values each (a, b) as the pairs an AVX512_BF16 dot product
// takes: `low` holds dimensions 0-15 (a's first, b's first, a's second...), `high` 16-31.
inline void interleave_positions(__m512i a, __m512i b, __m512i& low, __m512i& high) {
  const __m512i low_words = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                             39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i high_words = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24,
                                              55, 23, 54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
  low = _mm512_permutex2var_epi16(a, low_words, b);
  high = _mm512_permutex2var_epi16(a, high_words, b);
}

// The same sums for bfloat16 values with the weights rounded to bfloat16 (`weights`, a
// row every `stride` >= end + 1 values, zero past the row's positions): two positions
// at a time, their values interleaved dimension by dimension into pairs, each pair
// multiplied by the two weights in one AVX512_BF16 dot product: half the multiplies of
// `accumulate` and no widening of the values. 1 thread, Zen 4, 64 sequences x 192
// positions of the 125M benchmark model: 0.73 -> 0.55-0.58 ms a layer with the cache
// hot; with 12 layers' caches read from memory the step stays at 10.4-10.7 ms (14 GB/s,
// the reads decide it there). The weights' rounding is the tiled prefill's (below).
template <int kVecs, int kRows>
inline void accumulate_pairs(const at::BFloat16* cache, const int64_t* slots, int64_t head_offset, int64_t begin,
                             int64_t end, const at::BFloat16* weights, int64_t stride, float* sums) {
  static_assert(kVecs % 2 == 0, "whole vectors of 32 bfloat16 values");
  __m512 total[kRows][kVecs];
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kVecs; ++c) total[r][c] = _mm512_loadu_ps(sums + r * 16 * kVecs + 16 * c);
  }
  for (int64_t p = begin; p < end; p += 2) {
    const at::BFloat16* first = cache + slots[p] + head_offset;
    const at::BFloat16* second = p + 1 < end ? cache + slots[p + 1] + head_offset : nullptr;
    __m512i pairs[kVecs];
    for (int c = 0; c < kVecs / 2; ++c) {
      const __m512i a = _mm512_loadu_si512(first + 32 * c);
      const __m512i b = second != nullptr ? _mm512_loadu_si512(second + 32 * c) : _mm512_setzero_si512();
      interleave_positions(a, b, pairs[2 * c], pairs[2 * c + 1]);
    }
    for (int r = 0; r < kRows; ++r) {
      uint32_t both;
      std::memcpy(&both, weights + r * stride + p, sizeof(both));
      const __m512bh weight = (__m512bh)_mm512_set1_epi32(static_cast<int>(both));
      for (int c = 0; c < kVecs; ++c) total[r][c] = _mm512_dpbf16_ps(total[r][c], weight, (__m512bh)pairs[c]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kVecs; ++c) _mm512_storeu_ps(sums + r * 16 * kVecs + 16 * c, total[r][c]);
  }
}
#endif

// What one task of `attention_avx512` covers: a sequence, its KV heads [first_kv,
// first_kv + num_heads), and its query tokens [first_token, first_token + num_tokens)
// (indices within the sequence's query).
struct AttentionTask {
  int64_t seq, first_kv, num_heads, first_token, num_tokens;
};

// Query tokens of a prefill scored together: each key read serves them all.
constexpr int64_t kQueryTile = 16;

// Attention of each query row over its sequence's cached context up to its own
// position, causally: the step's decodes (one token each) and prefill chunks alike.
// query [N, H, D] holds sequence s's tokens at rows [query_start[s], query_start[s + 1]),
// the last of them at position seq_lens[s] - 1. kVecs = head_dim / 16 float vectors a
// row; kRows query rows accumulated at once.
template <typename scalar_t, int kVecs>
void attention_avx512(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens,
                      const at::Tensor& query_start, double scale, at::Tensor& out, const uint8_t* skip) {
  using L = Lanes<scalar_t, kVecs>;
  constexpr int kQuery = L::kQuery;
#ifdef __AVX512BF16__
  constexpr bool kPairs = std::is_same_v<scalar_t, at::BFloat16> && kVecs % 2 == 0;
#else
  constexpr bool kPairs = false;
#endif
  constexpr int kRows = kVecs >= 16 ? 1 : std::min(8, 16 / kVecs);
  const DecodeLayout<scalar_t> shape(query, k_cache, v_cache, block_tables, seq_lens, out);
  const int64_t num_seqs = seq_lens.size(0), group = shape.group, head_dim = shape.head_dim;
  const int32_t* starts = query_start.data_ptr<int32_t>();
  const __m512 vscale = _mm512_set1_ps(static_cast<float>(scale));
  // Decodes as in the decode kernel (whole sequences a task when there are enough);
  // prefills a KV head and a tile of tokens a task.
  std::vector<AttentionTask> tasks;
  const bool all_decodes = query.size(0) == num_seqs;
  const int64_t decode_heads = all_decodes ? shape.heads_per_task : 1;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    if (skip != nullptr && skip[seq]) continue;  // another kernel attends for it
    const int64_t num_tokens = starts[seq + 1] - starts[seq];
    const int64_t heads = num_tokens == 1 ? decode_heads : 1;
    for (int64_t kv = 0; kv < shape.num_kv_heads; kv += heads) {
      for (int64_t t = 0; t < num_tokens; t += kQueryTile) {
        tasks.push_back({seq, kv, heads, t, std::min(kQueryTile, num_tokens - t)});
      }
    }
  }

  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<typename L::Query> q;
    std::vector<float> acc, scores;
    std::vector<at::BFloat16> rounded;
    std::vector<int64_t> slots, limits;
    for (int64_t index = begin; index < end; ++index) {
      const AttentionTask& task = tasks[index];
      const int64_t seq = task.seq, first_kv = task.first_kv, tile = task.num_tokens;
      const int64_t q_len = starts[seq + 1] - starts[seq];
      // Row r = (h * tile + t) * group + g: head first_kv + h, token first_token + t,
      // query head g of the KV head's group; it sees positions [0, limits[r]).
      const int64_t rows = task.num_heads * tile * group;
      const int64_t first_position = shape.lens[seq] - q_len + task.first_token;
      const int64_t len = first_position + tile;  // the last row's limit
      const int32_t* table = shape.tables + seq * shape.table_width;
      // Where each position's slot (its first KV head of this task) lies in a cache.
      slots.resize(len);
      for (int64_t start = 0, block = 0; start < len; start += shape.block_size, ++block) {
        const int64_t base = static_cast<int64_t>(table[block]) * shape.kv_stride_block + first_kv * shape.kv_stride_head;
        for (int64_t i = 0, n = std::min(shape.block_size, len - start); i < n; ++i) slots[start + i] = base + i * shape.kv_stride_slot;
      }
      auto slot = [&](const scalar_t* cache, int64_t pos) { return cache + slots[pos]; };
      const int64_t task_bytes = ((task.num_heads - 1) * shape.kv_stride_head + head_dim) * sizeof(scalar_t);
      // Into L2, not L1: prefetches to L1 held the core's few L1 miss slots and stalled
      // (float32, 1 thread, batch 64 x 192 positions, 12 cold layers: 8 GB/s read to L1,
      // 13 to L2 together with the prefetches below, against 24 streaming).
      auto prefetch = [&](const scalar_t* cache, int64_t pos) {
        const char* first = reinterpret_cast<const char*>(slot(cache, pos));
        for (int64_t offset = 0; offset < task_bytes; offset += kCacheLine) __builtin_prefetch(first + offset, 0, 1);
      };
      // The first tiles' keys and values at once; the scores' pass then fetches the keys
      // kAhead tiles on and the values beside them, so that the values' pass finds them
      // in the cache (a sequence's context of a few hundred positions fits the L2).
      for (int64_t p = 0, e = std::min(len, kAhead * kTile); p < e; ++p) {
        prefetch(shape.k_ptr, p);
        prefetch(shape.v_ptr, p);
      }
      q.resize(rows * kQuery);
      limits.resize(rows);
      for (int64_t h = 0; h < task.num_heads; ++h) {
        for (int64_t t = 0; t < tile; ++t) {
          const int64_t token = starts[seq] + task.first_token + t;
          for (int64_t g = 0; g < group; ++g) {
            const int64_t r = (h * tile + t) * group + g;
            const scalar_t* src = shape.q_ptr + token * shape.q_stride_seq + ((first_kv + h) * group + g) * shape.q_stride_head;
            for (int c = 0; c < kQuery; ++c) q[r * kQuery + c] = L::query(src, c);
            limits[r] = first_position + t + 1;
          }
        }
      }
      const int64_t head_rows = tile * group;
      scores.resize(rows * len + kTile);
      // Scores, a tile of positions at a time (a partial tile one position at a time).
      int64_t pos = 0;
      for (; pos + kTile <= len; pos += kTile) {
        // The keys kAhead tiles on, spread over the rows' work: a burst of a whole
        // tile's prefetches at once left most of them to arrive late (cold caches:
        // 1.6 -> 1.0 ms a layer at 64 sequences x 192 positions).
        const int64_t ahead = pos + kAhead * kTile, ahead_end = std::min(len, ahead + kTile);
        for (int64_t h = 0; h < task.num_heads; ++h) {
          for (int64_t r = h * head_rows; r < (h + 1) * head_rows; ++r) {
            for (int64_t p = ahead + r * kTile / rows, e = std::min(ahead_end, ahead + (r + 1) * kTile / rows); p < e; ++p) {
              prefetch(shape.k_ptr, p);
              prefetch(shape.v_ptr, p);
            }
            __m512 dots[kTile];
            for (int64_t p = 0; p < kTile; ++p) {
              const scalar_t* key = slot(shape.k_ptr, pos + p) + h * shape.kv_stride_head;
              dots[p] = L::dot(q.data() + r * kQuery, key);
            }
            _mm512_storeu_ps(scores.data() + r * len + pos, _mm512_mul_ps(sum_each(dots), vscale));
          }
        }
      }
      for (; pos < len; ++pos) {
        for (int64_t h = 0; h < task.num_heads; ++h) {
          const scalar_t* key = slot(shape.k_ptr, pos) + h * shape.kv_stride_head;
          for (int64_t r = h * head_rows; r < (h + 1) * head_rows; ++r) {
            scores[r * len + pos] = _mm512_reduce_add_ps(L::dot(q.data() + r * kQuery, key)) * static_cast<float>(scale);
          }
        }
      }
      // Each row's softmax over the positions it sees; the rest weigh nothing.
      for (int64_t r = 0; r < rows; ++r) softmax_row(scores.data() + r * len, limits[r], len);
      // Bfloat16 values take the weights rounded to bfloat16, a row every `pair_stride`
      // (an even count, a zero past the last position).
      const int64_t pair_stride = (len + 2) / 2 * 2;
      if constexpr (kPairs) {
        rounded.resize(rows * pair_stride);
        for (int64_t r = 0; r < rows; ++r) {
          const float* row = scores.data() + r * len;
          at::BFloat16* out_row = rounded.data() + r * pair_stride;
          for (int64_t p = 0; p < pair_stride; p += 16) {
            const __m512 x = p < len ? _mm512_maskz_loadu_ps(first_lanes(len - p), row + p) : _mm512_setzero_ps();
            _mm256_mask_storeu_epi16(out_row + p, first_lanes(pair_stride - p), (__m256i)_mm512_cvtneps_pbh(x));
          }
        }
      }
      // This task's values are on their way; start the next task's first tiles, so that
      // it does not begin by waiting for memory.
      if (index + 1 < end) {
        const AttentionTask& next = tasks[index + 1];
        const int64_t next_len = std::min(kAhead * kTile, shape.lens[next.seq] - (starts[next.seq + 1] - starts[next.seq])
                                                              + next.first_token + next.num_tokens);
        const int32_t* next_table = shape.tables + next.seq * shape.table_width;
        const int64_t next_bytes = ((next.num_heads - 1) * shape.kv_stride_head + head_dim) * sizeof(scalar_t);
        for (int64_t p = 0; p < next_len; ++p) {
          const int64_t at = static_cast<int64_t>(next_table[p / shape.block_size]) * shape.kv_stride_block +
                             (p % shape.block_size) * shape.kv_stride_slot + next.first_kv * shape.kv_stride_head;
          for (const scalar_t* cache : {shape.k_ptr, shape.v_ptr}) {
            const char* first = reinterpret_cast<const char*>(cache + at);
            for (int64_t offset = 0; offset < next_bytes; offset += kCacheLine) __builtin_prefetch(first + offset, 0, 1);
          }
        }
      }
      // Values: rows of one KV head kRows at a time, in registers over a tile of positions.
      acc.assign(rows * head_dim, 0.0f);
      for (int64_t first = 0; first < len; first += kTile) {
        const int64_t last = std::min(len, first + kTile);
        // The values kAhead tiles on, spread over the work of the row groups.
        const int64_t ahead = first + kAhead * kTile, ahead_end = std::min(len, ahead + kTile);
        const int64_t groups = (head_rows + kRows - 1) / kRows, num_groups = task.num_heads * groups;
        for (int64_t h = 0; h < task.num_heads; ++h) {
          for (int64_t r0 = h * head_rows; r0 < (h + 1) * head_rows; r0 += kRows) {
            const int64_t j = h * groups + (r0 - h * head_rows) / kRows;
            for (int64_t p = ahead + j * kTile / num_groups, e = std::min(ahead_end, ahead + (j + 1) * kTile / num_groups);
                 p < e; ++p) {
              prefetch(shape.v_ptr, p);
            }
            // Rows whose positions all lie before this tile take nothing from it.
            if (limits[std::min(r0 + kRows, (h + 1) * head_rows) - 1] <= first) continue;
            const float* weights = scores.data() + r0 * len;
            float* sums = acc.data() + r0 * head_dim;
            const int64_t offset = h * shape.kv_stride_head;
#ifdef __AVX512BF16__
            if constexpr (kPairs) {
              const at::BFloat16* w = rounded.data() + r0 * pair_stride;
              switch (std::min<int64_t>(kRows, (h + 1) * head_rows - r0)) {
                case 1: accumulate_pairs<kVecs, 1>(shape.v_ptr, slots.data(), offset, first, last, w, pair_stride, sums); break;
                case 2: accumulate_pairs<kVecs, 2>(shape.v_ptr, slots.data(), offset, first, last, w, pair_stride, sums); break;
                case 3: accumulate_pairs<kVecs, 3>(shape.v_ptr, slots.data(), offset, first, last, w, pair_stride, sums); break;
                case 4: accumulate_pairs<kVecs, 4>(shape.v_ptr, slots.data(), offset, first, last, w, pair_stride, sums); break;
                case 5: accumulate_pairs<kVecs, 5>(shape.v_ptr, slots.data(), offset, first, last, w, pair_stride, sums); break;
                case 6: accumulate_pairs<kVecs, 6>(shape.v_ptr, slots.data(), offset, first, last, w, pair_stride, sums); break;
                case 7: accumulate_pairs<kVecs, 7>(shape.v_ptr, slots.data(), offset, first, last, w, pair_stride, sums); break;
                default: accumulate_pairs<kVecs, 8>(shape.v_ptr, slots.data(), offset, first, last, w, pair_stride, sums); break;
              }
              continue;
            }
#endif
            switch (std::min<int64_t>(kRows, (h + 1) * head_rows - r0)) {
              case 1: accumulate<scalar_t, kVecs, 1>(shape.v_ptr, slots.data(), offset, first, last, weights, len, sums); break;
              case 2: accumulate<scalar_t, kVecs, 2>(shape.v_ptr, slots.data(), offset, first, last, weights, len, sums); break;
              case 3: accumulate<scalar_t, kVecs, 3>(shape.v_ptr, slots.data(), offset, first, last, weights, len, sums); break;
              case 4: accumulate<scalar_t, kVecs, 4>(shape.v_ptr, slots.data(), offset, first, last, weights, len, sums); break;
              case 5: accumulate<scalar_t, kVecs, 5>(shape.v_ptr, slots.data(), offset, first, last, weights, len, sums); break;
              case 6: accumulate<scalar_t, kVecs, 6>(shape.v_ptr, slots.data(), offset, first, last, weights, len, sums); break;
              case 7: accumulate<scalar_t, kVecs, 7>(shape.v_ptr, slots.data(), offset, first, last, weights, len, sums); break;
              default: accumulate<scalar_t, kVecs, 8>(shape.v_ptr, slots.data(), offset, first, last, weights, len, sums); break;
            }
          }
        }
      }
      for (int64_t h = 0; h < task.num_heads; ++h) {
        for (int64_t t = 0; t < tile; ++t) {
          const int64_t token = starts[seq] + task.first_token + t;
          for (int64_t g = 0; g < group; ++g) {
            const int64_t r = (h * tile + t) * group + g;
            scalar_t* o = shape.out_ptr + token * out.stride(0) + ((first_kv + h) * group + g) * out.stride(1);
            for (int c = 0; c < kVecs; ++c) L::store(o, c, _mm512_loadu_ps(acc.data() + r * head_dim + 16 * c));
          }
        }
      }
    }
  });
}

// The vector kernel for this element type and head size, or nullptr (the portable one runs).
// The last argument: sequences to leave out (nonzero), or nullptr for none.
using AttentionFn = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, double, at::Tensor&, const uint8_t*);
template <typename scalar_t>
AttentionFn vector_kernel_for(int64_t head_dim) {
  switch (head_dim) {
    case 32: return &attention_avx512<scalar_t, 2>;
    case 64: return &attention_avx512<scalar_t, 4>;
    case 96: return &attention_avx512<scalar_t, 6>;
    case 128: return &attention_avx512<scalar_t, 8>;
    case 256: return &attention_avx512<scalar_t, 16>;
    default: return nullptr;
  }
}

inline AttentionFn vector_kernel_for(at::ScalarType dtype, int64_t head_dim) {
  if (dtype == at::ScalarType::Float) return vector_kernel_for<float>(head_dim);
#ifdef __AVX512BF16__
  if (dtype == at::ScalarType::BFloat16) return vector_kernel_for<at::BFloat16>(head_dim);
#endif
  return nullptr;
}
#endif  // CADENCE_AVX512

#ifdef CADENCE_AVX2
// Decode attention in AVX2 vectors (float32, and bfloat16 widened to float32 as it is
// read), for heads of a multiple of 32 dimensions:
// the tasks of `decode_attention`, keys and values prefetched into L2 as in
// `attention_avx512`, eight positions' scores reduced together, the values accumulated in registers
// for up to three query rows and 32 dimensions at a time, each value read once a pass.
// Measured on a 2-core Zen 3 VM (AVX2, no AVX-512), one thread, 64 sequences x 192
// positions of the 125M benchmark model's attention, 12 layers' caches read from
// memory: 29.3 ms a step against the portable kernel's 42.4 (10.3 GB/s against 7.1; the
// memory streams at ~21). Reads are what is left: the scores alone take ~21 ms.
// Element j of the result is the sum of the lanes of a[j].
inline __m256 sum_each8(const __m256* a) {
  const __m256 q0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 q1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}

// Positions the scores' pass prefetches ahead (16 and 64: 3-9% slower), and the values'
// pass (without it, 19% slower: not every value is still in the cache by then).
constexpr int64_t kAvx2Ahead = 32;
constexpr int64_t kValuesAhead = 16;

// out rows [kRows] (each a head_dim row at `out`, a row every `out_stride`), dimensions
// [32 * chunk, 32 * chunk + 32) = sum over positions p of weights[r * stride + p] * value(p).
// 8 values as float32 lanes: float32 as it is, bfloat16 widened (exact).
inline __m256 load8(const float* src) { return _mm256_loadu_ps(src); }
inline __m256 load8(const at::BFloat16* src) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

template <int kRows, bool kAhead, typename scalar_t>
inline void values_avx2(const scalar_t* cache, const int64_t* slots, int64_t len, const float* weights, int64_t stride,
                        int64_t chunk, float* out, int64_t out_stride) {
  __m256 acc[kRows][4];
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  for (int64_t p = 0; p < len; ++p) {
    const scalar_t* value = cache + slots[p] + 32 * chunk;
    if (kAhead && p + kValuesAhead < len) {
      const char* soon = reinterpret_cast<const char*>(cache + slots[p + kValuesAhead] + 32 * chunk);
      __builtin_prefetch(soon);
      __builtin_prefetch(soon + 64);
    }
    const __m256 v0 = load8(value), v1 = load8(value + 8), v2 = load8(value + 16), v3 = load8(value + 24);
    for (int r = 0; r < kRows; ++r) {
      const __m256 w = _mm256_broadcast_ss(weights + r * stride + p);
      acc[r][0] = _mm256_fmadd_ps(w, v0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w, v1, acc[r][1]);
      acc[r][2] = _mm256_fmadd_ps(w, v2, acc[r][2]);
      acc[r][3] = _mm256_fmadd_ps(w, v3, acc[r][3]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(out + r * out_stride + 32 * chunk + 8 * c, acc[r][c]);
  }
}

// Float32, or bfloat16 widened to float32 as it is read (the portable kernel's sums: the
// result is rounded to bfloat16 once at the end). A prompt's rows, each a one-token query
// one position on from the row before (`DecodeLayout::follows`), find that row's keys and
// values in the cache: they prefetch nothing and extend its slots by one (a separate
// instance of the task's code, so a decode's is the same as before). Measured (1 thread,
// Zen 3, same sums): 7 prompts of 128 rows, heads of 32, 0.93 ms against 1.47; heads of
// 64, 5.3 against 6.5; one prompt of 1,024, 48 against 54; decodes of caches read from
// memory unchanged (0.99-1.02x).
template <typename scalar_t>
void decode_attention_avx2(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                           at::Tensor& out) {
  constexpr bool kWide = std::is_same_v<scalar_t, float>;
  const DecodeLayout<scalar_t> shape(query, k_cache, v_cache, block_tables, seq_lens, out);
  const __m256 fscale = _mm256_set1_ps(static_cast<float>(scale));
  const int64_t vecs = shape.head_dim / 8, out_seq = out.stride(0), out_head = out.stride(1);
  at::parallel_for(0, shape.num_seqs * shape.tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    const int64_t rows = shape.heads_per_task * shape.group;
    std::vector<float> scores, sums(kWide ? 0 : rows * shape.head_dim);
    std::vector<int64_t> slots;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / shape.tasks_per_seq, first_kv = (task % shape.tasks_per_seq) * shape.heads_per_task;
      const int64_t len = shape.lens[seq], padded = (len + 7) / 8 * 8;
      // A prompt's next row after the row before it on this thread: its keys and values
      // are in the cache (nothing to prefetch) and its slots are the row before's and one.
      const bool hot = task > begin && shape.tasks_per_seq == 1 && static_cast<int64_t>(slots.size()) == len - 1 &&
                       shape.follows(seq);
      auto attend = [&](auto hot_row) {
        constexpr bool kHot = decltype(hot_row)::value;
        // Each position's slot (its first KV head of this task), as an offset into a cache.
        if constexpr (kHot) {
          slots.push_back(shape.slot_offset(seq, first_kv, len - 1));
        } else {
          slots.resize(len);
          for (int64_t pos = 0; pos < len; ++pos) slots[pos] = shape.slot_offset(seq, first_kv, pos);
        }
        // Into L2 (as `attention_avx512`): the first tiles' keys and values at once, then
        // during the scores, the keys and values kAvx2Ahead positions on, spread over the
        // rows' work, so that the values' pass finds them in the cache.
        auto fetch = [&](const scalar_t* cache, int64_t offset) {
          const char* first = reinterpret_cast<const char*>(cache + offset);
          for (int64_t at = 0; at < shape.task_bytes; at += kCacheLine) __builtin_prefetch(first + at, 0, 1);
        };
        auto prefetch = [&](const scalar_t* cache, int64_t offset) {
          if constexpr (!kHot) fetch(cache, offset);
        };
        for (int64_t p = 0; p < std::min(len, kAvx2Ahead); ++p) {
          prefetch(shape.k_ptr, slots[p]);
          prefetch(shape.v_ptr, slots[p]);
        }
        scores.resize(rows * padded);
        for (int64_t p0 = 0; p0 < len; p0 += 8) {
          const int64_t ahead = p0 + kAvx2Ahead, ahead_end = std::min(len, ahead + 8);
          // Positions past the context score the tile's first key again; softmax_row zeroes them.
          const scalar_t* keys[8];
          for (int j = 0; j < 8; ++j) keys[j] = shape.k_ptr + slots[p0 + j < len ? p0 + j : p0];
          for (int64_t h = 0; h < shape.heads_per_task; ++h) {
            for (int64_t g = 0; g < shape.group; ++g) {
              const int64_t r = h * shape.group + g;
              for (int64_t p = ahead + r * 8 / rows, e = std::min(ahead_end, ahead + (r + 1) * 8 / rows); p < e; ++p) {
                prefetch(shape.k_ptr, slots[p]);
                prefetch(shape.v_ptr, slots[p]);
              }
              const scalar_t* q =
                  shape.q_ptr + seq * shape.q_stride_seq + (first_kv * shape.group + r) * shape.q_stride_head;
              __m256 acc[8];
              for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
              for (int64_t c = 0; c < vecs; ++c) {
                const __m256 qc = load8(q + 8 * c);
                for (int j = 0; j < 8; ++j) {
                  acc[j] = _mm256_fmadd_ps(qc, load8(keys[j] + h * shape.kv_stride_head + 8 * c), acc[j]);
                }
              }
              _mm256_storeu_ps(scores.data() + r * padded + p0, _mm256_mul_ps(sum_each8(acc), fscale));
            }
          }
        }
        // The next task's first positions, while this one's values are read from the cache.
        if (task + 1 < end && !(kHot && shape.follows(seq + 1))) {
          const int64_t next_seq = (task + 1) / shape.tasks_per_seq;
          const int64_t next_kv = ((task + 1) % shape.tasks_per_seq) * shape.heads_per_task;
          for (int64_t p = 0, e = std::min<int64_t>(shape.lens[next_seq], kAvx2Ahead); p < e; ++p) {
            const int64_t at = shape.slot_offset(next_seq, next_kv, p);
            fetch(shape.k_ptr, at);
            fetch(shape.v_ptr, at);
          }
        }
        for (int64_t r = 0; r < rows; ++r) softmax_row(scores.data() + r * padded, len, padded);
        for (int64_t h = 0; h < shape.heads_per_task; ++h) {
          const scalar_t* cache = shape.v_ptr + h * shape.kv_stride_head;
          for (int64_t g0 = 0; g0 < shape.group; g0 += 3) {
            const int64_t r0 = h * shape.group + g0, n = std::min<int64_t>(3, shape.group - g0);
            const float* weights = scores.data() + r0 * padded;
            // Float32 sums straight into the result; bfloat16's into `sums`, rounded below.
            float* o;
            int64_t o_stride;
            if constexpr (kWide) {
              o = shape.out_ptr + seq * out_seq + (first_kv * shape.group + r0) * out_head;
              o_stride = out_head;
            } else {
              o = sums.data() + r0 * shape.head_dim;
              o_stride = shape.head_dim;
            }
            for (int64_t chunk = 0; chunk < shape.head_dim / 32; ++chunk) {
              if (n == 3) values_avx2<3, !kHot>(cache, slots.data(), len, weights, padded, chunk, o, o_stride);
              else if (n == 2) values_avx2<2, !kHot>(cache, slots.data(), len, weights, padded, chunk, o, o_stride);
              else values_avx2<1, !kHot>(cache, slots.data(), len, weights, padded, chunk, o, o_stride);
            }
          }
        }
        if constexpr (!kWide) {
          for (int64_t r = 0; r < rows; ++r) {
            scalar_t* o = shape.out_ptr + seq * out_seq + (first_kv * shape.group + r) * out_head;
            for (int64_t d = 0; d < shape.head_dim; ++d) o[d] = static_cast<scalar_t>(sums[r * shape.head_dim + d]);
          }
        }
      };
      if (hot) {
        attend(std::true_type{});
      } else {
        attend(std::false_type{});
      }
    }
  });
}
#endif  // CADENCE_AVX2

}  // namespace

// Round a float to bfloat16 (nearest, ties to even; any NaN to the quiet NaN) and
// back, as torch's bfloat16 ops store results: in bit operations, so loops of it
// vectorize.
inline float round_bfloat16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  rounded = (bits & 0x7fffffffu) > 0x7f800000u ? 0x7fc00000u : rounded;
  float out;
  std::memcpy(&out, &rounded, sizeof(out));
  return out;
}
// x stored in scalar_t and read back.
template <typename scalar_t>
inline float stored(float x) { return static_cast<float>(static_cast<scalar_t>(x)); }
template <>
inline float stored<at::BFloat16>(float x) { return round_bfloat16(x); }
// x, already a value of scalar_t, as one.
template <typename scalar_t>
inline scalar_t exact(float x) { return static_cast<scalar_t>(x); }
template <>
inline at::BFloat16 exact<at::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return at::BFloat16(static_cast<uint16_t>(bits >> 16), at::BFloat16::from_bits());
}

// RMSNorm of rows of x [rows, dim] scaled by weight [dim], in float32; with `residual`,
// of residual + x, which is also returned (the next residual). Each intermediate is
// stored in the tensors' dtype where torch's unfused ops store it, so the results are
// those of the unfused ops up to the order of the sum of squares.
template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, const scalar_t* residual, const scalar_t* weight, scalar_t* out,
                   scalar_t* total_out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(dim);
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * dim;
      if (residual != nullptr) {
        const scalar_t* rr = residual + r * dim;
        scalar_t* tr = total_out + r * dim;
        for (int64_t d = 0; d < dim; ++d) {
          tr[d] = static_cast<scalar_t>(to_float(xr[d]) + to_float(rr[d]));
          row[d] = to_float(tr[d]);
        }
      } else {
        load_row(xr, row.data(), dim);
      }
      float squares = 0.0f;
      for (int64_t d = 0; d < dim; ++d) squares += row[d] * row[d];
      const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(dim) + eps);
      scalar_t* o = out + r * dim;
      for (int64_t d = 0; d < dim; ++d) {
        o[d] = static_cast<scalar_t>(to_float(weight[d]) * stored<scalar_t>(row[d] * inverse));
      }
    }
  });
}

std::vector<at::Tensor> rms_norm(at::Tensor x, at::Tensor weight, double eps,
                                 c10::optional<at::Tensor> residual) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm needs contiguous inputs");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must share a dtype");
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  auto out = at::empty_like(x);
  at::Tensor total;
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() &&
                residual->scalar_type() == x.scalar_type(), "residual must match x");
    total = at::empty_like(x);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr,
                            weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            residual.has_value() ? total.data_ptr<scalar_t>() : nullptr, rows, dim,
                            static_cast<float>(eps));
  });
  if (residual.has_value()) return {out, total};
  return {out};
}

// Rotate x [tokens, heads, head_dim] (any strides but a contiguous last dimension) in
// place by the angles of cos/sin [tokens, head_dim] (rotate-half layout: dimension i
// pairs with i + head_dim / 2), rounding as torch's x * cos + rotate_half(x) * sin does.
template <typename scalar_t>
void rotate_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  const int64_t stride_token = x.stride(0), stride_head = x.stride(1);
  const int64_t out_token = out.stride(0), out_head = out.stride(1);
  const scalar_t* base = x.data_ptr<scalar_t>();
  scalar_t* out_base = out.data_ptr<scalar_t>();
  const scalar_t* c = cos.data_ptr<scalar_t>();
  const scalar_t* s = sin.data_ptr<scalar_t>();
  const int64_t table = cos.stride(0);
  at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* ct = c + t * table;
      const scalar_t* st = s + t * table;
      for (int64_t h = 0; h < heads; ++h) {
        const scalar_t* row = base + t * stride_token + h * stride_head;
        scalar_t* to = out_base + t * out_token + h * out_head;
        // Each output element depends on its own inputs only (the row may be the output).
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = to_float(row[i]), b = to_float(row[i + half]);
          const float first = stored<scalar_t>(stored<scalar_t>(a * to_float(ct[i])) +
                                               stored<scalar_t>(-b * to_float(st[i])));
          const float second = stored<scalar_t>(stored<scalar_t>(b * to_float(ct[i + half])) +
                                                stored<scalar_t>(a * to_float(st[i + half])));
          to[i] = exact<scalar_t>(first);
          to[i + half] = exact<scalar_t>(second);
        }
      }
    }
  });
}

#ifdef CADENCE_AVX512
// round_bfloat16 of 16 lanes.
inline __m512 round_bfloat16_lanes(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), odd),
                                     _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
  return _mm512_castsi512_ps(rounded);
}
// 16 lanes that are bfloat16 values already, as bfloat16.
inline __m256i exact_bfloat16_lanes(__m512 x) {
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16));
}

// rotate_rows for bfloat16 and a head size a multiple of 32, in 16-lane vectors: the
// same roundings, so the same values (a long prefill's rotary embedding took ~11 ms a
// layer at 8,192 tokens on the 125M model as the compiler left the scalar loop).
void rotate_rows_bfloat16(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                          at::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2, chunks = half / 16;
  const int64_t stride_token = x.stride(0), stride_head = x.stride(1);
  const int64_t out_token = out.stride(0), out_head = out.stride(1), table = cos.stride(0);
  const auto* base = x.data_ptr<at::BFloat16>();
  auto* out_base = out.data_ptr<at::BFloat16>();
  const auto* c = cos.data_ptr<at::BFloat16>();
  const auto* s = sin.data_ptr<at::BFloat16>();
  auto load = [](const at::BFloat16* src) { return widen_bfloat16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))); };
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t k = 0; k < chunks; ++k) {
        const __m512 cos_first = load(c + t * table + 16 * k), cos_second = load(c + t * table + half + 16 * k);
        const __m512 sin_first = load(s + t * table + 16 * k), sin_second = load(s + t * table + half + 16 * k);
        for (int64_t h = 0; h < heads; ++h) {
          const at::BFloat16* row = base + t * stride_token + h * stride_head + 16 * k;
          at::BFloat16* to = out_base + t * out_token + h * out_head + 16 * k;
          const __m512 a = load(row), b = load(row + half);
          const __m512 first = round_bfloat16_lanes(_mm512_add_ps(
              round_bfloat16_lanes(_mm512_mul_ps(a, cos_first)),
              round_bfloat16_lanes(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), b), sin_first))));
          const __m512 second = round_bfloat16_lanes(_mm512_add_ps(
              round_bfloat16_lanes(_mm512_mul_ps(b, cos_second)), round_bfloat16_lanes(_mm512_mul_ps(a, sin_second))));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(to), exact_bfloat16_lanes(first));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + half), exact_bfloat16_lanes(second));
        }
      }
    }
  });
}
#endif

// Rotate rows as rotate_rows does, in vectors where the dtype and head size allow.
void rotate_any(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
#ifdef CADENCE_AVX512
  if (x.scalar_type() == at::kBFloat16 && x.size(2) % 32 == 0) {
    rotate_rows_bfloat16(x, cos, sin, out);
    return;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, x.scalar_type(), "rotary", [&] {
    rotate_rows<scalar_t>(x, cos, sin, out);
  });
}

void check_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary needs x [tokens, heads, head_dim], last dim contiguous");
  TORCH_CHECK(cos.dim() == 2 && cos.stride(1) == 1 && cos.sizes() == sin.sizes() && cos.strides() == sin.strides(),
              "cos and sin must be [tokens, head_dim]");
  TORCH_CHECK(cos.size(0) == x.size(0) && cos.size(1) == x.size(2), "cos and sin must match x");
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && cos.scalar_type() == sin.scalar_type(),
              "x, cos and sin must share a dtype");
}

// Rotate x in place.
void rotary(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  check_rotary(x, cos, sin);
  rotate_any(x, cos, sin, x);
}

// x rotated, as a new contiguous tensor (x, a view of a wider row, is left as it is).
at::Tensor rotated(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  check_rotary(x, cos, sin);
  auto out = at::empty(x.sizes(), x.options());
  rotate_any(x, cos, sin, out);
  return out;
}

inline bool is_nan_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return (bits & 0x7fffffffu) > 0x7f800000u;  // in bits: -ffast-math drops std::isnan
}

// The index of the largest of row[0, n), the first of several equal ones, or of the
// first NaN: torch.argmax's answer.
template <typename scalar_t>
int64_t argmax_row(const scalar_t* row, int64_t n) {
  int64_t start = 0, best = 0;
  float best_value = -std::numeric_limits<float>::infinity();
#ifdef CADENCE_AVX512
  if (n >= 16) {
    auto load = [&](int64_t i) {
      if constexpr (std::is_same_v<scalar_t, float>) {
        return _mm512_loadu_ps(row + i);
      } else if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
        return widen_bfloat16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i)));
      } else {
        float values[16];
        for (int j = 0; j < 16; ++j) values[j] = to_float(row[i + j]);
        return _mm512_loadu_ps(values);
      }
    };
    // Each lane keeps its first largest value and where it was; NaNs are looked for apart.
    __m512 lane_best = load(0);
    __m512i lane_index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i index = lane_index;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(lane_best, lane_best, _CMP_UNORD_Q);
    for (start = 16; start + 16 <= n; start += 16) {
      const __m512 values = load(start);
      index = _mm512_add_epi32(index, step);
      const __mmask16 larger = _mm512_cmp_ps_mask(values, lane_best, _CMP_GT_OQ);
      lane_best = _mm512_mask_mov_ps(lane_best, larger, values);
      lane_index = _mm512_mask_mov_epi32(lane_index, larger, index);
      nan |= _mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q);
    }
    if (nan) {
      for (int64_t i = 0; i < start; ++i) {
        if (is_nan_bits(to_float(row[i]))) return i;
      }
    }
    float values[16];
    int32_t indices[16];
    _mm512_storeu_ps(values, lane_best);
    _mm512_storeu_si512(indices, lane_index);
    best = indices[0];
    best_value = values[0];
    for (int j = 1; j < 16; ++j) {
      if (values[j] > best_value || (values[j] == best_value && indices[j] < best)) {
        best = indices[j];
        best_value = values[j];
      }
    }
  }
#endif
  for (int64_t i = start; i < n; ++i) {
    const float value = to_float(row[i]);
    if (is_nan_bits(value)) return i;
    if (value > best_value || i == 0) {
      best = i;
      best_value = value;
    }
  }
  return best;
}

// argmax over the last dimension of x [rows, n] (contiguous rows): int64 [rows].
at::Tensor argmax(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "argmax needs x [rows, n] with contiguous rows");
  TORCH_CHECK(x.size(1) > 0, "argmax of an empty row");
  TORCH_CHECK(x.size(1) < (int64_t{1} << 31), "rows must have fewer than 2^31 values");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* result = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, x.scalar_type(), "argmax", [&] {
    const scalar_t* base = x.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) result[r] = argmax_row(base + r * stride, n);
    });
  });
  return out;
}

void check_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(query.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "head dimension must be contiguous");
  TORCH_CHECK(k_cache.strides() == v_cache.strides(), "key and value caches must share a layout");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "query and caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
}

// query [num_seqs, num_heads, head_dim] (one token per sequence); caches
// [num_blocks, block_size, num_kv_heads, head_dim]; block_tables [num_seqs, width]
// int32; seq_lens [num_seqs] int32, each >= 1. Returns [num_seqs, num_heads, head_dim].
at::Tensor paged_decode_attention(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens, double scale) {
  check_attention(query, k_cache, v_cache, block_tables, seq_lens);
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = at::empty_like(query);
#ifdef CADENCE_AVX512
  if (AttentionFn fast = vector_kernel_for(query.scalar_type(), query.size(2))) {
    auto starts = at::arange(query.size(0) + 1, lens.options());
    fast(query, k_cache, v_cache, tables, lens, starts, scale, out, nullptr);
    return out;
  }
#endif
#ifdef CADENCE_AVX2
  if (query.size(2) % 32 == 0 && query.scalar_type() == at::kFloat) {
    decode_attention_avx2<float>(query, k_cache, v_cache, tables, lens, scale, out);
    return out;
  }
  if (query.size(2) % 32 == 0 && query.scalar_type() == at::kBFloat16) {
    decode_attention_avx2<at::BFloat16>(query, k_cache, v_cache, tables, lens, scale, out);
    return out;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, query.scalar_type(),
                                  "paged_decode_attention", [&] {
    decode_attention<scalar_t>(query, k_cache, v_cache, tables, lens, scale, out);
  });
  return out;
}

// Whether `paged_decode_attention` has a vector kernel for a query like this one (its
// dtype and head size) here: then it also serves a prefill, one query row at a time,
// each row given its own block table and context length (the runner's per-row tables,
// `AttentionMetadata.row_block_tables`).
bool has_row_attention(const at::Tensor& query) {
#ifdef CADENCE_AVX512
  if (vector_kernel_for(query.scalar_type(), query.size(-1)) != nullptr) return true;
#endif
#ifdef CADENCE_AVX2
  return query.size(-1) % 32 == 0 &&
         (query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16);
#else
  return false;
#endif
}

// Whether `paged_attention` takes a query like this one (its dtype and head size) here.
bool has_paged_attention(const at::Tensor& query) {
#ifdef CADENCE_AVX512
  return vector_kernel_for(query.scalar_type(), query.size(-1)) != nullptr;
#else
  return false;
#endif
}

// ---- products of a few rows: decode steps of small batches ------------------------------
//
// oneDNN's product reads a prepacked weight at ~30 GB/s for one row but slows to two
// thirds of that at eight (its blocking is made for large batches). A product of at
// most kSmallRows rows reads the weight once, as groups of kSmallColumns outputs (its
// layout: `pack_small_batch` in cpu_kernels.py), each pair of inputs of a group one
// 128-byte run; every row's pair is broadcast against it (AVX512_BF16 dot products,
// float32 sums), so the weight streams at the memory's pace for any row count up to eight.
constexpr int64_t kSmallRows = 8;
#ifdef CADENCE_AVX2
constexpr int64_t kSmallColumns = 16;  // with AVX2: `small_product_rows` below
#else
constexpr int64_t kSmallColumns = 32;
#endif
// Up to kProductRows rows the product runs here too: each group's weight is read from
// memory by a first run of at most kTileRows rows and from the core's L2 cache by the
// others (14 rows x 32 outputs take 28 of the 32 vector registers as sums). Measured on
// the 125M benchmark model's 49 products of a decode step against oneDNN's prepacked
// ones, 2 threads: 0.72-0.76x the time at 8-32 rows, 0.86x at 64, 0.93x at 128 and
// 0.99-1.06x at 256-512 (float32; bfloat16 alike); 1 thread: 0.74x at 32, 0.88x at
// 64, 1.01x at 128.
// With AVX2 (16 registers of 8 floats) a run takes at most 6 rows: `small_product_rows`
// below.
#ifdef CADENCE_AVX512
constexpr int64_t kTileRows = 14;
#else
constexpr int64_t kTileRows = 6;
#endif
constexpr int64_t kProductRows = 128;

#ifdef __AVX512BF16__
// Half `half` of group g's 32 outputs: which of its 16 exist (`mask`) and their bias in
// float32 (`shift`); false where none do.
inline bool bfloat16_half(int64_t g, int half, int64_t out_features, const at::BFloat16* bias, __mmask16& mask,
                          __m512& shift) {
  const int64_t first = g * kSmallColumns + half * 16;
  if (first >= out_features) return false;
  mask = first_lanes(out_features - first);
  shift = _mm512_setzero_ps();
  if (bias != nullptr) shift = widen_bfloat16(_mm256_maskz_loadu_epi16(mask, bias + first));
  return true;
}

// sum + shift rounded to bfloat16 once, stored at the outputs `mask` keeps.
inline void store_bfloat16_sums(at::BFloat16* dst, __mmask16 mask, __m512 sum, __m512 shift) {
  _mm256_mask_storeu_epi16(dst, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sum, shift)));
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define CADENCE_AMX 1
// Bfloat16 on AMX tiles, from the same packed weight: a group's pairs of inputs are
// rows of 128 bytes, the first 64 its first 16 outputs' pairs and the next 64 the
// other 16's, so 16 pairs of one half, read with a stride of 128 bytes, are one B tile
// as TDPBF16PS wants it (16 rows of 16 outputs x 2 inputs); A tiles are 16 rows x 32
// inputs of x. Measured on a 2-core Xeon VM with AMX, one thread, the 125M benchmark
// model's products (qkv 1280x768, o 768x768, gate/up 4096x768, down 768x2048, the
// 32k-way head), weights streamed from memory: at 8 rows 10.9-12.1 GB/s against oneDNN's
// prepacked product's 8.8-12.2 and the vector kernel's 9.4-10.0 (the 48 products of the
// layers 12.9 ms against oneDNN's 15.0), at 32 rows 9.6-10.4 against 8.3-9.9, at one row
// level with the vector kernel; and at 512 rows oneDNN's blocking is 1.5-1.9x faster (~1
// TFLOP/s at best here against 1.1-1.45). Between them, the 48 products of the layers
// one after another, each weight cold (600 MB written between sittings), 1 thread: at 48
// rows 18.3 ms against oneDNN's 22.7, at 64 20.1-21.0 against 22.8-26.7, at 96 25.5
// against 27.6, at 128 31.9-32.8 against 29.9-31.3; 2 threads at 64 11.1 against 16.1,
// at 96 13.9 against 18.4, at 128 17.0 against 19.7 (a product measured on its own, its
// weight in the cache, had put the crossover at 64 rows). The 64-sequence decode
// step's decoder stack, the runner alone, alternated: 41.1-42.9 ms against 45.4-45.6
// with a bound of 32 rows (1 thread), 22.1-22.7 against 24.9-25.0 (2 threads).
// So on AMX a bfloat16 product of at most kAmxKernelRows rows runs here, larger ones on
// oneDNN's copy (`product_rows`). Below kAmxMinRows rows the vector kernel runs: its
// rows are all real where a tile multiplies 16, and a whole decode step of the 125M
// model (1 thread, the runner alone, two sittings) took 15.5-16.6 ms at 4 sequences
// and 17.6-18.1 at 6 on it against 17.3-18.2 and 18.4-19.5 on the tiles; at 8, 20.9-21.6
// against 19.9-20.8 (and 23.7-23.8 on oneDNN, the path before the tiles); one row in
// bfloat16 on tiles also slowed the demo model's batch-1 decode by ~7%, its weights hot
// in the cache (compute then counts, and 15 of the tile's 16 rows are padding).
constexpr int64_t kAmxKernelRows = 96;
constexpr int64_t kAmxMinRows = 8;
struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands a process the tile registers' state only on request.
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permitted;
}

constexpr int64_t kAmxTile = 16;       // rows of an A or sum tile, pairs of a B tile
constexpr int64_t kAmxTileInputs = 32;  // inputs of an A tile: 64 bytes

// Every kernel here configures all eight tiles alike: 16 rows of 64 bytes. The
// configuration is a static object: GCC does not see LDTILECFG read the 64 bytes it is
// given, so the stores that fill a local configuration may be dropped as dead (a
// function that only built a local one and loaded it kept the palette byte alone).
void configure_full_tiles() {
  static const TileConfig config = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.rows[t] = kAmxTile;
      c.colsb[t] = 64;
    }
    return c;
  }();
  _tile_loadconfig(&config);
}

// Groups [first_group, last_group) of the weight against x's `blocks` blocks of 16 rows
// (x padded to whole blocks; `rows` of them real), one block at a time: two sum tiles
// (the group's halves, 0-1), A tiles 2-3 and B tiles 4-7 taking pairs of input blocks
// in turn, so that loading the next never waits on a product still reading the last.
// Sums in float32, plus bias, rounded once.
void amx_product_groups(const at::BFloat16* x, int64_t blocks, int64_t rows, int64_t inputs,
                        const at::BFloat16* weight, const at::BFloat16* bias, at::BFloat16* y,
                        int64_t out_features, int64_t first_group, int64_t last_group) {
  configure_full_tiles();
  alignas(64) float sums[kAmxTile][kSmallColumns];
  const int64_t group_elements = inputs * kSmallColumns, a_stride = inputs * 2;
  const int64_t b_stride = 2 * kSmallColumns * 2, k_blocks = inputs / kAmxTileInputs;
  constexpr int64_t b_step = kAmxTile * 2 * kSmallColumns;
  for (int64_t g = first_group; g < last_group; ++g) {
    const at::BFloat16* group = weight + g * group_elements;
    for (int64_t block = 0; block < blocks; ++block) {
      const at::BFloat16* a = x + block * kAmxTile * inputs;
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t kb = 0; kb < k_blocks; kb += 2) {
        const at::BFloat16* b = group + kb * b_step;
        _tile_loadd(4, b, b_stride);
        _tile_loadd(5, b + kAmxTile * 2, b_stride);
        _tile_loadd(2, a + kb * kAmxTileInputs, a_stride);
        _tile_dpbf16ps(0, 2, 4);
        _tile_dpbf16ps(1, 2, 5);
        if (kb + 1 < k_blocks) {
          _tile_loadd(6, b + b_step, b_stride);
          _tile_loadd(7, b + b_step + kAmxTile * 2, b_stride);
          _tile_loadd(3, a + (kb + 1) * kAmxTileInputs, a_stride);
          _tile_dpbf16ps(0, 3, 6);
          _tile_dpbf16ps(1, 3, 7);
        }
      }
      _tile_stored(0, &sums[0][0], kSmallColumns * 4);
      _tile_stored(1, &sums[0][16], kSmallColumns * 4);
      const int64_t here = std::min<int64_t>(kAmxTile, rows - block * kAmxTile);
      __mmask16 mask;
      __m512 shift;
      for (int half = 0; half < 2 && bfloat16_half(g, half, out_features, bias, mask, shift); ++half) {
        at::BFloat16* out = y + block * kAmxTile * out_features + g * kSmallColumns + half * 16;
        for (int64_t r = 0; r < here; ++r) {
          store_bfloat16_sums(out + r * out_features, mask, _mm512_load_ps(&sums[r][half * 16]), shift);
        }
      }
    }
  }
  _tile_release();
}

// Whether a bfloat16 product of this many inputs runs on the tiles here: whole A tiles,
// and the tile state granted.
inline bool amx_serves(int64_t in_features) { return in_features % kAmxTileInputs == 0 && amx_permitted(); }

// x [M, K] (K a multiple of 32) times the packed bfloat16 weight, on AMX tiles.
void amx_product(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                 at::Tensor& y, int64_t out_features) {
  const int64_t rows = x.size(0), inputs = x.size(1), blocks = (rows + kAmxTile - 1) / kAmxTile;
  const auto* xs = x.data_ptr<at::BFloat16>();
  // A last block of fewer than 16 rows is read from a copy padded with zeros (the
  // tiles read 16 rows whatever the count).
  thread_local std::vector<at::BFloat16> padded;
  if (rows % kAmxTile != 0 || x.stride(0) != inputs) {
    padded.resize(blocks * kAmxTile * inputs);
    for (int64_t r = 0; r < rows; ++r) std::memcpy(padded.data() + r * inputs, xs + r * x.stride(0), inputs * 2);
    std::fill(padded.begin() + rows * inputs, padded.end(), at::BFloat16(0.0f));
    xs = padded.data();
  }
  const auto* w = packed.data_ptr<at::BFloat16>();
  const at::BFloat16* b = bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr;
  auto* ys = y.data_ptr<at::BFloat16>();
  const int64_t groups = packed.size(0);
  at::parallel_for(0, groups, 8, [&](int64_t begin, int64_t end) {
    amx_product_groups(xs, blocks, rows, inputs, w, b, ys, out_features, begin, end);
  });
}
#endif

// The most rows a product of this dtype and shape takes here where oneDNN's copy is kept.
// Where the CPU has AMX, oneDNN multiplies bfloat16 on its tiles, and bfloat16 keeps
// oneDNN's copy (`cpu_linear.LARGE_BATCH_ONEDNN_DTYPES`). Where this build has the tile
// kernel above (and the product's inputs fill whole tiles), a bfloat16 product takes it
// for at most kAmxKernelRows rows, or for more the smaller it is (below). Otherwise the
// vector kernel's bound: measured on a 2-core Xeon VM with AMX, the 125M benchmark
// model's four product shapes
// (qkv, gate/up, down, the 32k-way head), oneDNN's time over this kernel's: 1.1-1.4 at
// one row, 0.75-1.25 at four, 0.5-0.67 at eight, 0.12-0.2 at 64 and beyond (1 and 2
// threads). So there bfloat16 takes at most kAmxRows rows here, or more for a small
// product: oneDNN's call costs ~17 us whatever its size, and the kernel's bfloat16 time
// grows as rows x outputs x inputs (~19 ps a multiply-add there), so a product runs here
// while its rows are at most kAmxMacs / (outputs x inputs). On the demo model's shapes
// (hidden 128, intermediate 384, a 260-token head), 1 thread, the crossover was 16-32
// rows, and the bound gives them 10-32 (with 4 for every product, 8 sequences of 128
// tokens took 0.164-0.178 s against 0.135-0.170 before the AMX rule; with this bound
// 0.130-0.134 against 0.134-0.136, and at 64 sequences 0.47-0.48 against 0.59).
constexpr int64_t kAmxRows = 4;
constexpr int64_t kAmxMacs = int64_t(1) << 20;
inline int64_t product_rows(at::ScalarType dtype, [[maybe_unused]] int64_t out_features,
                            [[maybe_unused]] int64_t in_features) {
#ifdef __AMX_BF16__
  if (dtype == at::kBFloat16) {
    const int64_t macs = std::max<int64_t>(1, out_features * in_features);
    int64_t rows = std::max(kAmxRows, kAmxMacs / macs);
#ifdef CADENCE_AMX
    if (amx_serves(in_features)) rows = std::max(rows, kAmxKernelRows);
#endif
    return std::min(kProductRows, rows);
  }
#endif
  return kProductRows;
}
// Weight runs a product of several rows prefetches ahead of the one it multiplies
// (8 KiB): the hardware's prefetcher alone left them waiting on memory (at 8 rows,
// 15-19 -> 24-29 GB/s in bfloat16 and float32 over 48 weights of the 125M model; a
// decode step at batch 8, 12.5 -> 8.6-11 ms in bfloat16, 23 -> 16-18.5 in float32).
// One row streams as fast without on a Zen 5 core; on a Xeon with AMX, one row in
// bfloat16 does not (a decode step at batch 1 of the 125M model, alternated processes:
// 128 tokens in 1.96-2.04 s against 2.13-2.27 at 1 thread, 0.99-1.08 against 1.19-1.24
// at 2; the 49 products alone 17.0 against 18.9-20.4 ms), so bfloat16 prefetches at
// every row count. Float32 (0.96 of that machine's bandwidth at one row) is unchanged.
constexpr int64_t kSmallAhead = 64;

// A share of the next group's weight that a run of rows prefetches as it goes, so that
// a product of several runs reads its weight from memory during all of them: 128 bytes
// (two lines) every `every` steps of the run's inputs, from `from` up to `to`.
struct FetchShare {
  const char* from = nullptr;
  const char* to = nullptr;
  int64_t every = 1;
};
// One step of a run: the share's next 128 bytes when their turn comes.
inline void fetch_share(FetchShare& share, int64_t& countdown) {
  if (share.from < share.to && --countdown == 0) {
    countdown = share.every;
    __builtin_prefetch(share.from);
    __builtin_prefetch(share.from + 64);
    share.from += 128;
  }
}

#ifdef CADENCE_AVX512
// acc += w * x[0] in every lane, the broadcast of x[0] folded into the multiply-add as
// its memory operand: the compiler keeps one broadcast register for a row's two
// multiply-adds instead. 1 thread, Zen 4, the 125M model's products at 64 rows, three
// alternations of the two builds: 103.7-106.4 -> 105.6-109.2 GFLOP/s (gate/up),
// 106.4-107.3 -> 108.9-109.6 (the 32k-way head), the others within 0-2% (the core's
// peak is 117); the 64 x 128/128 batch through the runner, eight alternations, median
// 29.45 -> 29.03 s (29.16-29.49 against 28.93-29.51).
// Arithmetic unchanged (one rounding, the same order). Runs of fewer rows, whose weight
// comes from memory at the pace of its reads, keep the register: one row folded slowed
// the batch-1 decode step 13.7-14.4 -> 15.6-16.2 ms. In bfloat16 the same folding
// (VDPBF16PS with a broadcast operand) ran at 92 GFLOP/s against 210: not used there.
constexpr int kFoldRows = 10;
inline void fmadd_broadcast(__m512& acc, __m512 w, const float* x) {
  asm("vfmadd231ps %[x]%{1to16%}, %[w], %[acc]" : [acc] "+v"(acc) : [w] "v"(w), [x] "m"(*x));
}

// Float32: each input of a group is one 128-byte run of its 32 outputs' weights.
template <int kM, bool kFetch = true>
void small_product_rows(const float* x, int64_t x_stride, const float* weight, const float* bias, float* y,
                        int64_t y_stride, int64_t inputs, int64_t out_features, int64_t first_group,
                        int64_t last_group, FetchShare share = {}) {
  int64_t countdown = 1;
  for (int64_t g = first_group; g < last_group; ++g) {
    __m512 sums[kM][2];
    for (int m = 0; m < kM; ++m) sums[m][0] = sums[m][1] = _mm512_setzero_ps();
    const float* group = weight + g * inputs * kSmallColumns;
    for (int64_t k = 0; k < inputs; ++k) {
      fetch_share(share, countdown);
      if (kM > 1 && kFetch) {
        const char* soon = reinterpret_cast<const char*>(group + (k + kSmallAhead) * kSmallColumns);
        __builtin_prefetch(soon);
        __builtin_prefetch(soon + 64);
      }
      const __m512 low = _mm512_loadu_ps(group + k * kSmallColumns);
      const __m512 high = _mm512_loadu_ps(group + k * kSmallColumns + 16);
      for (int m = 0; m < kM; ++m) {
        if constexpr (kM >= kFoldRows) {
          fmadd_broadcast(sums[m][0], low, x + m * x_stride + k);
          fmadd_broadcast(sums[m][1], high, x + m * x_stride + k);
        } else {
          const __m512 value = _mm512_set1_ps(x[m * x_stride + k]);
          sums[m][0] = _mm512_fmadd_ps(value, low, sums[m][0]);
          sums[m][1] = _mm512_fmadd_ps(value, high, sums[m][1]);
        }
      }
    }
    for (int half = 0; half < 2; ++half) {
      const int64_t first = g * kSmallColumns + half * 16;
      if (first >= out_features) break;
      const __mmask16 mask = first_lanes(out_features - first);
      const __m512 shift = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + first) : _mm512_setzero_ps();
      for (int m = 0; m < kM; ++m) _mm512_mask_storeu_ps(y + m * y_stride + first, mask, _mm512_add_ps(sums[m][half], shift));
    }
  }
}
#endif

#ifdef CADENCE_AVX2
// The first min(n, 8) of 8 lanes as an AVX2 mask (n >= 1).
inline __m256i first_lanes8(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Float32 with AVX2 and FMA (16 registers of 8 floats): a group is 16 outputs, each input
// one 64-byte run of their weights (two vectors), and a run of up to 6 rows keeps its 12
// sums in registers beside the two weight vectors and a broadcast. Each sum runs over
// the inputs in order, whatever the rows of the run: a row's result does not depend on
// the batch (sums of even and odd inputs kept apart below 4 rows would have hidden the
// multiplier's latency there, but were no faster with the weights read from memory).
// Measured on a 2-core Zen 3 VM (AVX2, no AVX-512), one thread, the 125M benchmark
// model's 49 products of a decode step, weights read from memory, against oneDNN's
// prepacked products alternated: 1 row 22.0 ms against 27.8, 6 rows 29.4 against 42.7,
// 8 36.5 against 49.2, 16 56 against 68, 64 164 against 189; a product of 128 to 2,048
// rows of one weight 0.80-0.91x oneDNN's time (86-93 GFLOP/s). Groups of 32 outputs,
// taken 16 a pass, were slower than oneDNN from 3 rows (each pass read every other
// line); software prefetching made one to three rows 5-15% slower; blocks of 128-512
// inputs, so that a product's later runs of rows read the weight from L1, 2-7% slower.
// (kFetch: the AVX-512 kernels' signature, which the dispatch shares; nothing is prefetched here.)
template <int kM, bool kFetch = true>
void small_product_rows(const float* x, int64_t x_stride, const float* weight, const float* bias, float* y,
                        int64_t y_stride, int64_t inputs, int64_t out_features, int64_t first_group,
                        int64_t last_group, FetchShare = {}) {
  static_assert(kSmallColumns == 16, "two vectors of 8 outputs a group");
  for (int64_t g = first_group; g < last_group; ++g) {
    const float* group = weight + g * inputs * kSmallColumns;
    __m256 sums[kM][2];
    for (int m = 0; m < kM; ++m) sums[m][0] = sums[m][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < inputs; ++k) {
      const __m256 low = _mm256_loadu_ps(group + k * kSmallColumns);
      const __m256 high = _mm256_loadu_ps(group + k * kSmallColumns + 8);
      for (int m = 0; m < kM; ++m) {
        const __m256 value = _mm256_broadcast_ss(x + m * x_stride + k);
        sums[m][0] = _mm256_fmadd_ps(value, low, sums[m][0]);
        sums[m][1] = _mm256_fmadd_ps(value, high, sums[m][1]);
      }
    }
    for (int half = 0; half < 2; ++half) {
      const int64_t at = g * kSmallColumns + 8 * half;
      if (at >= out_features) break;
      const __m256i mask = first_lanes8(out_features - at);
      const __m256 shift = bias != nullptr ? _mm256_maskload_ps(bias + at, mask) : _mm256_setzero_ps();
      for (int m = 0; m < kM; ++m) _mm256_maskstore_ps(y + m * y_stride + at, mask, _mm256_add_ps(sums[m][half], shift));
    }
  }
}

// A 32-bit lane holding two bfloat16 values (the pair layout: the even input's low,
// the odd one's high) as float32 lanes: the even value shifted up 16 bits, the odd one
// with the low half cleared (both exact).
inline __m256 even_of_pairs(__m256i lanes) { return _mm256_castsi256_ps(_mm256_slli_epi32(lanes, 16)); }
inline __m256 odd_of_pairs(__m256i lanes) {
  return _mm256_castsi256_ps(_mm256_and_si256(lanes, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// 8 float32 lanes rounded to bfloat16 (nearest, ties to even; any NaN to the quiet NaN,
// as `round_bfloat16`), their bits in the low halves of the lanes.
inline __m256i bfloat16_bits8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  return _mm256_srli_epi32(_mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc00000), nan), 16);
}

// Bfloat16 with AVX2 and FMA, in the layout of the AVX512_BF16 kernel with groups of 16
// outputs: each pair of inputs of a group is one 64-byte run, a 32-bit lane per output
// holding its two weights. The even input's weight is the lane shifted up by 16 bits and
// the odd one's the lane with its low half cleared, both exact in float32, and so are
// the inputs, broadcast a pair at a time; the products are exact and the sums run in
// float32 over the inputs in order (the float32 kernel's, so a row's result does not
// depend on the batch), rounded to bfloat16 once with the bias.
// kG groups g0, g0 + 1, ... side by side: their sums are independent chains, so a few
// rows do not wait on the multiplier's latency (each input pair adds two products to a
// sum in turn); each sum's order is the one-group order.
template <int kM, int kG>
inline void bfloat16_groups_avx2(const at::BFloat16* x, int64_t x_stride, const at::BFloat16* weight,
                                 const at::BFloat16* bias, at::BFloat16* y, int64_t y_stride, int64_t inputs,
                                 int64_t out_features, int64_t g0) {
  const int64_t pairs = inputs / 2;
  __m256 sums[kG][kM][2];
  for (int q = 0; q < kG; ++q) {
    for (int m = 0; m < kM; ++m) sums[q][m][0] = sums[q][m][1] = _mm256_setzero_ps();
  }
  for (int64_t kp = 0; kp < pairs; ++kp) {
    __m256 low_even[kG], high_even[kG], low_odd[kG], high_odd[kG];
    for (int q = 0; q < kG; ++q) {
      const at::BFloat16* run = weight + ((g0 + q) * pairs + kp) * 2 * kSmallColumns;
      const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(run));
      const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(run + 16));
      low_even[q] = even_of_pairs(low);
      high_even[q] = even_of_pairs(high);
      low_odd[q] = odd_of_pairs(low);
      high_odd[q] = odd_of_pairs(high);
    }
    for (int m = 0; m < kM; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * x_stride + 2 * kp, sizeof(pair));
      const __m256i both = _mm256_set1_epi32(pair);
      const __m256 even = even_of_pairs(both), odd = odd_of_pairs(both);
      for (int q = 0; q < kG; ++q) {
        sums[q][m][0] = _mm256_fmadd_ps(even, low_even[q], sums[q][m][0]);
        sums[q][m][1] = _mm256_fmadd_ps(even, high_even[q], sums[q][m][1]);
      }
      for (int q = 0; q < kG; ++q) {
        sums[q][m][0] = _mm256_fmadd_ps(odd, low_odd[q], sums[q][m][0]);
        sums[q][m][1] = _mm256_fmadd_ps(odd, high_odd[q], sums[q][m][1]);
      }
    }
  }
  for (int q = 0; q < kG; ++q) {
    const int64_t g = g0 + q;
    for (int half = 0; half < 2; ++half) {
      const int64_t first = g * kSmallColumns + 8 * half;
      if (first >= out_features) break;
      const int64_t n = std::min<int64_t>(8, out_features - first);
      alignas(32) float shift_lanes[8] = {};
      if (bias != nullptr) {
        for (int64_t i = 0; i < n; ++i) shift_lanes[i] = static_cast<float>(bias[first + i]);
      }
      const __m256 shift = _mm256_load_ps(shift_lanes);
      for (int m = 0; m < kM; ++m) {
        const __m256i bits = bfloat16_bits8(_mm256_add_ps(sums[q][m][half], shift));
        // Eight 16-bit values: packed within each 128-bit half, then the halves joined.
        const __m128i packed = _mm256_castsi256_si128(
            _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08));
        at::BFloat16* dst = y + m * y_stride + first;
        if (n == 8) {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), packed);
        } else {
          alignas(16) uint16_t lanes[8];
          _mm_store_si128(reinterpret_cast<__m128i*>(lanes), packed);
          std::memcpy(dst, lanes, n * sizeof(uint16_t));
        }
      }
    }
  }
}

template <int kM, bool kFetch = true>
void small_product_rows(const at::BFloat16* x, int64_t x_stride, const at::BFloat16* weight,
                        const at::BFloat16* bias, at::BFloat16* y, int64_t y_stride, int64_t inputs,
                        int64_t out_features, int64_t first_group, int64_t last_group, FetchShare = {}) {
  static_assert(kSmallColumns == 16, "two vectors of 8 outputs a group");
  // Up to 3 rows, three groups at a time: a pair of inputs adds two products to each
  // sum in turn, so one group's few sums leave the multipliers waiting on their latency
  // (measured on the 125M model's 49 products of a decode step, Zen 3, 1 thread,
  // weights from memory, alternated builds: 1 row 10.0-10.5 ms against 13.7-14.2 a
  // group at a time, that is 20 GB/s, the memory's pace; 2 rows 10.7-11.1 against
  // 14.8-15.0; 3 rows 13.9-14.2 against 15.4; two groups 11.1-11.5 at 1 row). From 4
  // rows the multipliers are busy enough: 4-8 rows within 1-6% either way.
  constexpr int kG = kM <= 3 ? 3 : 1;
  int64_t g = first_group;
  for (; g + kG <= last_group; g += kG) {
    bfloat16_groups_avx2<kM, kG>(x, x_stride, weight, bias, y, y_stride, inputs, out_features, g);
  }
  for (; g < last_group; ++g) {
    bfloat16_groups_avx2<kM, 1>(x, x_stride, weight, bias, y, y_stride, inputs, out_features, g);
  }
}
#endif

#ifdef __AVX512BF16__
// Bfloat16: each pair of inputs of a group is one 128-byte run of its 32 outputs' two weights.
template <int kM, bool kFetch = true>
void small_product_rows(const at::BFloat16* x, int64_t x_stride, const at::BFloat16* weight,
                        const at::BFloat16* bias, at::BFloat16* y, int64_t y_stride, int64_t inputs,
                        int64_t out_features, int64_t first_group, int64_t last_group, FetchShare share = {}) {
  const int64_t pairs = inputs / 2;
  int64_t countdown = 1;
  for (int64_t g = first_group; g < last_group; ++g) {
    __m512 sums[kM][2];
    for (int m = 0; m < kM; ++m) sums[m][0] = sums[m][1] = _mm512_setzero_ps();
    const at::BFloat16* group = weight + g * pairs * 2 * kSmallColumns;
    for (int64_t kp = 0; kp < pairs; ++kp) {
      fetch_share(share, countdown);
      if (kFetch) {
        const char* soon = reinterpret_cast<const char*>(group + (kp + kSmallAhead) * 2 * kSmallColumns);
        __builtin_prefetch(soon);
        __builtin_prefetch(soon + 64);
      }
      const __m512bh low = (__m512bh)_mm512_loadu_si512(group + kp * 2 * kSmallColumns);
      const __m512bh high = (__m512bh)_mm512_loadu_si512(group + kp * 2 * kSmallColumns + kSmallColumns);
      for (int m = 0; m < kM; ++m) {
        int32_t pair;
        std::memcpy(&pair, x + m * x_stride + 2 * kp, sizeof(pair));
        const __m512bh both = (__m512bh)_mm512_set1_epi32(pair);
        sums[m][0] = _mm512_dpbf16_ps(sums[m][0], both, low);
        sums[m][1] = _mm512_dpbf16_ps(sums[m][1], both, high);
      }
    }
    __mmask16 mask;
    __m512 shift;
    for (int half = 0; half < 2 && bfloat16_half(g, half, out_features, bias, mask, shift); ++half) {
      const int64_t first = g * kSmallColumns + half * 16;
      for (int m = 0; m < kM; ++m) store_bfloat16_sums(y + m * y_stride + first, mask, sums[m][half], shift);
    }
  }
}
#endif

template <typename scalar_t, bool kFetch>
void small_product_dispatch(int64_t rows, const scalar_t* x, int64_t x_stride, const scalar_t* w, const scalar_t* b,
                            scalar_t* y, int64_t y_stride, int64_t out_features, int64_t inputs, int64_t first_group,
                            int64_t last_group, FetchShare share = {}) {
#ifdef CADENCE_SMALL_FLOAT
#define CADENCE_ROWS_CASE(n) case n: small_product_rows<n, kFetch>(x, x_stride, w, b, y, y_stride, inputs, out_features, first_group, last_group, share); break;
  switch (rows) {
    CADENCE_ROWS_CASE(1) CADENCE_ROWS_CASE(2) CADENCE_ROWS_CASE(3) CADENCE_ROWS_CASE(4)
    CADENCE_ROWS_CASE(5) CADENCE_ROWS_CASE(6)
#ifdef CADENCE_AVX512
    CADENCE_ROWS_CASE(7) CADENCE_ROWS_CASE(8)
    CADENCE_ROWS_CASE(9) CADENCE_ROWS_CASE(10) CADENCE_ROWS_CASE(11) CADENCE_ROWS_CASE(12)
    CADENCE_ROWS_CASE(13) CADENCE_ROWS_CASE(14)
#endif
    default: break;
  }
#undef CADENCE_ROWS_CASE
#endif
}

template <typename scalar_t>
void small_product_all(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       at::Tensor& y, int64_t out_features) {
#ifdef CADENCE_SMALL_FLOAT
  const auto* xs = x.data_ptr<scalar_t>();
  const auto* w = packed.data_ptr<scalar_t>();
  const scalar_t* b = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
  auto* ys = y.data_ptr<scalar_t>();
  const int64_t rows = x.size(0), x_stride = x.stride(0), inputs = x.size(1), groups = packed.size(0);
  // Row runs over each group's weight, which the first run reads from memory and the
  // others from the cache. With AVX-512, of equal size (at most kTileRows each; one run
  // up to kSmallRows rows); with AVX2, of kTileRows and the rest last: fewer rows a run
  // wait on the multiplier's latency (Zen 3, weight in cache: 6 rows 94 GFLOP/s, 4 rows 60).
  // With several runs, each also prefetches its share of the next group's weight as it
  // goes (`FetchShare`; the AVX-512 kernels), so that the weight streams from memory
  // during all of a group's runs, not during the first alone (which then read at
  // ~20 GB/s while the others waited on nothing). The first group of a thread's range comes from memory as its
  // first run reads it, prefetching ahead of itself as a single run does. 1 thread,
  // Zen 4, the 125M model's 49 products of a decode step, weights from memory, two
  // alternations of the builds: bfloat16 24 rows 24.7-25.3 ms against 26.0-28.0, 28 rows
  // 29.0-29.1 against 31.6-32.3, 32 rows 31.2-32.1 against 34.6-36.1, 64 rows
  // 63.3-64.0 against 65.1-66.1, 16 rows within noise; float32 32 rows 61.9-63.1
  // against 68.9-75.0, 16 and 64 rows within noise; 2 threads, bfloat16 32 rows
  // 16.4-17.4 against 18.7.
#ifdef CADENCE_AVX512
  const int64_t runs = (rows + kTileRows - 1) / kTileRows, run_rows = runs ? (rows + runs - 1) / runs : 0;
#else
  const int64_t run_rows = std::min(rows, kTileRows);
#endif
  at::parallel_for(0, groups, rows > kSmallRows ? 4 : 8, [&](int64_t begin, int64_t end) {
#ifdef CADENCE_AVX2
    if (rows <= run_rows) {  // one run: the kernel takes the groups together (bfloat16: three at a time)
      small_product_dispatch<scalar_t, true>(rows, xs, x_stride, w, b, ys, out_features, out_features, inputs, begin, end);
      return;
    }
#endif
    const int64_t group_bytes = inputs * kSmallColumns * static_cast<int64_t>(sizeof(scalar_t));
    const int64_t num_runs = (rows + run_rows - 1) / run_rows;
    for (int64_t g = begin; g < end; ++g) {
      const char* next = reinterpret_cast<const char*>(w) + (g + 1) * group_bytes;
      for (int64_t first = 0, run = 0; first < rows; first += run_rows, ++run) {
        const scalar_t* xr = xs + first * x_stride;
        scalar_t* yr = ys + first * out_features;
        const int64_t n = std::min(run_rows, rows - first);
        FetchShare share;
        if (num_runs > 1 && g + 1 < end) {
          // Run r's share starts at r / num_runs of the group (whole 128-byte steps).
          auto cut = [&](int64_t r) {
            return next + (r == num_runs ? group_bytes : r * group_bytes / num_runs / 128 * 128);
          };
          share = {cut(run), cut(run + 1), num_runs};
        }
        if (first == 0 && (g == begin || num_runs == 1)) {
          small_product_dispatch<scalar_t, true>(n, xr, x_stride, w, b, yr, out_features, out_features, inputs, g, g + 1, share);
        } else {
          small_product_dispatch<scalar_t, false>(n, xr, x_stride, w, b, yr, out_features, out_features, inputs, g, g + 1, share);
        }
      }
    }
  });
#endif
}

#ifdef CADENCE_AVX2
// Bfloat16 products of more than one run of rows, with AVX2: there widening the weight's
// values in every run costs the multipliers' time (the runs after the first read it from
// the cache). So each group's weight is widened to float32 once, into a buffer the
// float32 kernel then reads for every run, from rows of x widened once; the float32 sums
// (the bfloat16 kernel's, in the same order: a row's result does not depend on the
// batch) and the bias are rounded to bfloat16 at the end.
// Up to kWidenRows rows, the bfloat16 kernel above widens the weight in every run of
// rows. Measured on the 125M model's 49 products of a decode step (Zen 3, 1 thread,
// weights from memory, alternated builds): 8-16 rows took 0.80-0.93x the time of
// widening once, 24 rows 1.17x, 32 rows 1.22x, 64 rows 1.25x (widened once, 64 rows
// run at ~81 GFLOP/s, the float32 kernel's pace).
constexpr int64_t kWidenRows = 16;
void widened_product(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                     at::Tensor& y, int64_t out_features) {
  const at::Tensor xf = x.to(at::kFloat);
  const c10::optional<at::Tensor> bf = bias.has_value() ? c10::optional<at::Tensor>(bias->to(at::kFloat)) : c10::nullopt;
  at::Tensor yf = at::empty({x.size(0), out_features}, x.options().dtype(at::kFloat));
  const float* xs = xf.data_ptr<float>();
  const float* b = bf.has_value() ? bf->data_ptr<float>() : nullptr;
  const auto* w = reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>());
  float* ys = yf.data_ptr<float>();
  const int64_t rows = x.size(0), inputs = x.size(1), groups = packed.size(0), pairs = inputs / 2;
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> wide(inputs * kSmallColumns + 8);
    float* group_wide = wide.data();
    for (int64_t g = begin; g < end; ++g) {
      // The group's [pairs][16 outputs][2 inputs] as float32 [inputs][16 outputs].
      const uint32_t* group = w + g * pairs * kSmallColumns;
      for (int64_t kp = 0; kp < pairs; ++kp) {
        for (int half = 0; half < 2; ++half) {
          const __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + kp * kSmallColumns + 8 * half));
          _mm256_storeu_ps(group_wide + (2 * kp) * kSmallColumns + 8 * half, even_of_pairs(lanes));
          _mm256_storeu_ps(group_wide + (2 * kp + 1) * kSmallColumns + 8 * half, odd_of_pairs(lanes));
        }
      }
      // The float32 kernel over this one group (its weight at group_wide as group 0, its
      // outputs `outputs` of a row every out_features).
      const float* shifted_bias = b == nullptr ? nullptr : b + g * kSmallColumns;
      const int64_t outputs = std::min<int64_t>(kSmallColumns, out_features - g * kSmallColumns);
      for (int64_t first = 0; first < rows; first += kTileRows) {
        const int64_t n = std::min(kTileRows, rows - first);
        small_product_dispatch<float, false>(n, xs + first * inputs, inputs, group_wide, shifted_bias,
                                             ys + first * out_features + g * kSmallColumns, out_features, outputs,
                                             inputs, 0, 1);
      }
    }
  });
  y.copy_(yf);
}
#endif

// Rows of x whose stride is a multiple of 4 KiB (inputs of 1,024 float32 values, or
// 2,048 bfloat16 ones, or a multiple: most models' hidden and MLP sizes) fall in one set
// of the L1 cache (8 ways), so a run's 13-14 rows, each broadcast a value at a time,
// evict one another. With AVX-512 such rows are copied 64 bytes apart from that stride
// first (the product's arithmetic is unchanged). Measured on a 2-core Zen 4 VM, one
// thread, 768 outputs, 64 rows: K = 2,048 ran at 86 GFLOP/s in float32 and 127 in
// bfloat16 against 109 / 209 at K = 1,536; K = 1,024 float32 at 94 against 112 at 768;
// with the copy (its time included) 110 / 219 and 112. AVX2 builds, whose runs take at
// most 6 rows, are left as they are (not measured there); so is the AMX tile product,
// which does not come here.
inline at::Tensor unaliased_rows(const at::Tensor& x) {
#ifdef CADENCE_AVX512
  const int64_t row_bytes = x.stride(0) * static_cast<int64_t>(x.element_size());
  if (x.size(0) >= 2 && row_bytes % 4096 == 0) {
    const int64_t pad = 64 / static_cast<int64_t>(x.element_size());
    at::Tensor rows = at::empty({x.size(0), x.size(1) + pad}, x.options()).narrow(1, 0, x.size(1));
    rows.copy_(x);
    return rows;
  }
#endif
  return x;
}

// x [M, K] (M <= kProductRows, contiguous rows) times the packed weight [groups, K / P,
// kSmallColumns, P] of a [out_features, K] one (P = 2 in bfloat16, 1 in float32), plus bias.
at::Tensor small_product(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K], rows contiguous");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "x and the weight must share a dtype");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.size(2) == kSmallColumns &&
              packed.size(1) * packed.size(3) == x.size(1) && packed.size(0) * kSmallColumns >= out_features,
              "packed weight does not fit x");
  TORCH_CHECK(!bias.has_value() || (bias->is_contiguous() && bias->numel() == out_features &&
                                    bias->scalar_type() == x.scalar_type()), "bias must be [out_features] of x's dtype");
  auto y = at::empty({x.size(0), out_features}, x.options());
  TORCH_CHECK(packed.size(3) == (x.scalar_type() == at::kBFloat16 ? 2 : 1),
              "float32 weights are packed one input at a time, bfloat16 two");
  // Blocks of kProductRows rows, each over every group of the weight (which stays in
  // the last-level cache from one block to the next).
  for (int64_t first = 0; first < x.size(0); first += kProductRows) {
    const int64_t n = std::min(kProductRows, x.size(0) - first);
    const at::Tensor xb = x.narrow(0, first, n);
    at::Tensor yb = y.narrow(0, first, n);
    if (x.scalar_type() == at::kFloat) {
      small_product_all<float>(unaliased_rows(xb), packed, bias, yb, out_features);
#ifdef CADENCE_SMALL_BFLOAT16
#ifdef CADENCE_AVX2
    } else if (x.scalar_type() == at::kBFloat16 && n > kWidenRows) {
      widened_product(xb, packed, bias, yb, out_features);
#endif
    } else if (x.scalar_type() == at::kBFloat16) {
#ifdef CADENCE_AMX
      if (n >= kAmxMinRows && amx_serves(x.size(1))) {
        amx_product(xb, packed, bias, yb, out_features);
        continue;
      }
#endif
      small_product_all<at::BFloat16>(unaliased_rows(xb), packed, bias, yb, out_features);
#endif
    } else {
      TORCH_CHECK(false, "the small-batch product takes float32 (and bfloat16 with AVX512_BF16 or AVX2)");
    }
  }
  return y;
}

// The dtypes small_product takes on this CPU.
std::vector<std::string> small_product_dtypes() {
  std::vector<std::string> names;
#ifdef CADENCE_SMALL_FLOAT
  names.push_back("float32");
#endif
#ifdef CADENCE_SMALL_BFLOAT16
  names.push_back("bfloat16");
#endif
  return names;
}

// ---- the SwiGLU activation --------------------------------------------------------------
//
// silu(gate) * up of bfloat16 rows in one pass, rounded where torch's two ops round (silu
// in float32, rounded to bfloat16; the product of two bfloat16 values in float32,
// rounded): torch's silu and mul_ each read and write the whole [T, I] (a 1,024-token
// prefill of the 125M model spent 21 ms of its ~215 in them, one thread). exp is
// computed here (Cody-Waite reduction, a degree-7 polynomial, ~1 ulp in float32), so a
// value on the edge of a bfloat16 rounding may round the other way than torch's own.
// Float32 and CPUs without AVX512_BF16 take torch's ops.
#ifdef __AVX512BF16__
// exp(x) for x <= 0 (a NaN lane gives exp(-103.97), ~0).
inline __m512 exp_lanes(__m512 x) {
  // x <= 0 here; below -103.97 the result underflows to zero.
  x = _mm512_max_ps(x, _mm512_set1_ps(-103.97f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

void silu_mul_row(const at::BFloat16* gate, const at::BFloat16* up, at::BFloat16* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = first_lanes(n - i);
    const __m512 g = widen_bfloat16(_mm256_maskz_loadu_epi16(mask, gate + i));
    const __m512 u = widen_bfloat16(_mm256_maskz_loadu_epi16(mask, up + i));
    // sigmoid(g) from exp(-|g|) in (0, 1], which never overflows: 1 / (1 + e) for g >= 0,
    // e / (1 + e) below, and 0 where torch's exp(-g) overflows (so that the infinities
    // and NaNs come out as torch's do).
    const __m512 e = exp_lanes(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    const __m512 inverse = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __mmask16 vanishing = _mm512_cmp_ps_mask(g, _mm512_set1_ps(-88.7228394f), _CMP_LT_OQ);
    const __m512 sigmoid = _mm512_maskz_mov_ps(~vanishing, _mm512_mask_mul_ps(inverse, negative, inverse, e));
    const __m512 silu = _mm512_mul_ps(g, sigmoid);
    const __m512 rounded = widen_bfloat16((__m256i)_mm512_cvtneps_pbh(silu));
    _mm256_mask_storeu_epi16(out + i, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(rounded, u)));
  }
}
#endif

// gate, up [T, I] (rows of contiguous values, any row stride): silu(gate) * up, a new [T, I].
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type(),
              "gate and up must be [T, I] of one dtype");
#ifdef __AVX512BF16__
  if (gate.scalar_type() == at::kBFloat16 && gate.stride(1) == 1 && up.stride(1) == 1) {
    auto out = at::empty(gate.sizes(), gate.options());
    const int64_t rows = gate.size(0), width = gate.size(1);
    const auto* g = gate.data_ptr<at::BFloat16>();
    const auto* u = up.data_ptr<at::BFloat16>();
    auto* o = out.data_ptr<at::BFloat16>();
    const int64_t gs = gate.stride(0), us = up.stride(0);
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, width)), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) silu_mul_row(g + r * gs, u + r * us, o + r * width, width);
    });
    return out;
  }
#endif
  return at::silu(gate).mul_(up);
}

// ---- prefill attention in tiles of 16 query tokens ------------------------------------
//
// The vector kernel scores a prefill one query row against one key at a time (a dot
// product summed across lanes): ~13 cycles a query head and key whatever the chunk's
// length: 42 ms a layer for 64 prompts of 128 tokens on the 125M benchmark model (1
// thread, Xeon with AMX) and 28 ms for one prompt of 1,024, more than SDPA's 18 and 7.7
// and most of a prefill's time outside its products. So a bfloat16 prefill chunk of at
// least kTileQueryRows tokens is attended in tiles of 16 query tokens instead: for each
// sequence and KV head, its keys are copied once into blocks of 16 keys x 16 pairs of
// head dimensions (a pair of one key's dimensions a 32-bit word, 16 keys side by side:
// the B tile TDPBF16PS wants) and its values likewise (16 pairs of positions x 16
// dimensions); then for each query head of the group and tile of 16 query tokens, the
// scores of the rows against the keys they see are products of the tile's query rows
// with those blocks, the softmax of each row over its whole context runs in float32
// vectors, and the weights, rounded to bfloat16 (as a fused attention kernel on a GPU
// takes them), multiply the values' blocks, summed in float32. So a row's result differs
// from the vector kernel's by the weights' rounding (and the order of the sums).
//
// The products run on AMX tiles where the CPU has them (`AmxProducts`: 15 and 5.6-6.7 ms
// there; the 8,192-token prefill of 64 prompts 2.03 -> 1.64 s with the same products),
// else in AVX512_BF16 vectors (`VectorProducts`): each block row is one vector of 16
// keys' (or dimensions') pairs, multiplied against a pair of each of the 16 query rows
// (or of their weights) broadcast, 16 sums in registers; the query rows and the weights
// are laid out pair-major for it ([pair][16 rows]), so every broadcast is a 32-bit load
// at a fixed offset; the keys and the query rows are transposed into that order 16 x 16
// words at a time in registers. On a 2-core Zen 4 VM (no AMX), 1 thread, the 125M
// benchmark model's heads: 64 prompts of 128 tokens 31.6 -> 20.1-23.7 ms a layer, one
// prompt of 1,024 24.0 -> 11.4-12.3 ms (the products at ~1 dot product a cycle; the rest
// is the softmax and the copies).
//
// Greedy bfloat16 agreement of the 125M benchmark model with float32 transformers: 0.738
// of tokens on the tiles (0.759 with the vector kernel); with each weight split in two
// bfloat16 numbers (~16 bits of it, twice the value products) 0.728, and 40% slower at
// 1,024 tokens: the model's near ties decide such figures, not the weights' rounding, so
// the weights go in once.
#ifdef __AVX512BF16__
constexpr int64_t kTileQueryRows = 16;
// Process-wide switch (tests and benchmarks compare the kernels).
bool tile_attention_enabled = true;

// words[i][j] <-> words[j][i]: a 16 x 16 matrix of 32-bit words transposed in registers.
inline void transpose_words(__m512i* words) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(words[i], words[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(words[i], words[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    words[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    words[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    words[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    words[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // Each 128-bit lane now holds a 4 x 4 block in place; move the blocks.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(words[i], words[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(words[i], words[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(words[i + 8], words[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(words[i + 8], words[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    words[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    words[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    words[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    words[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

struct TileAttentionScratch {
  std::vector<uint32_t> keys;   // [key blocks of 16][dims / 32][16 dim pairs][16 keys]
  std::vector<uint32_t> values; // [position blocks of 32][dims / 16][16 position pairs][16 dims]
  std::vector<float> scores;    // [16 rows][width]
  std::vector<at::BFloat16> weights, query;  // [16 rows][width]; [16 rows][dims] (pair-major for the vectors)
  std::vector<float> sums;      // [16 rows][dims]
};

#ifdef CADENCE_AMX
// The tile's products on AMX tiles: query rows and weights row-major, as A tiles.
struct AmxProducts {
  static constexpr bool kPairMajor = false;
  static void begin() { configure_full_tiles(); }
  static void end() { _tile_release(); }
  // scores[m][16b + i] = query row m . key 16b + i, for key blocks [0, blocks).
  static void scores(const at::BFloat16* q_rows, int64_t q_stride, const uint32_t* keys, int64_t blocks,
                     int64_t k_chunks, float* scores, int64_t width) {
    for (int64_t b = 0; b < blocks; ++b) {
      _tile_zero(0);
      for (int64_t c = 0; c < k_chunks; ++c) {
        _tile_loadd(1, q_rows + 32 * c, q_stride);
        _tile_loadd(2, keys + (b * k_chunks + c) * 256, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, scores + 16 * b, width * 4);
    }
  }
  // sums[m][d] = the sum over positions [0, 32 x position_blocks) of weights[m][p] x value p's d.
  static void values(const at::BFloat16* weights, int64_t width, const uint32_t* values, int64_t position_blocks,
                     int64_t v_chunks, float* sums, int64_t dims) {
    // Four tiles of 16 dimensions at a time (tiles 0-3), the weights' 32 positions in
    // tile 4, the values' in 5-7 in turn.
    int64_t c = 0;
    for (; c + 4 <= v_chunks; c += 4) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t b = 0; b < position_blocks; ++b) {
        const uint32_t* v = values + (b * v_chunks + c) * 256;
        _tile_loadd(4, weights + 32 * b, width * 2);
        _tile_loadd(5, v, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, v + 256, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, v + 512, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, v + 768, 64);
        _tile_dpbf16ps(3, 4, 5);
      }
      _tile_stored(0, sums + 16 * c, dims * 4);
      _tile_stored(1, sums + 16 * (c + 1), dims * 4);
      _tile_stored(2, sums + 16 * (c + 2), dims * 4);
      _tile_stored(3, sums + 16 * (c + 3), dims * 4);
    }
    for (; c < v_chunks; ++c) {
      _tile_zero(0);
      for (int64_t b = 0; b < position_blocks; ++b) {
        _tile_loadd(4, weights + 32 * b, width * 2);
        _tile_loadd(5, values + (b * v_chunks + c) * 256, 64);
        _tile_dpbf16ps(0, 4, 5);
      }
      _tile_stored(0, sums + 16 * c, dims * 4);
    }
  }
};
#endif

// The tile's products in AVX512_BF16 vectors: query rows and weights pair-major
// ([pair][16 rows], 32-bit words), each pair broadcast against a block row.
struct VectorProducts {
  static constexpr bool kPairMajor = true;
  static void begin() {}
  static void end() {}
  static void scores(const uint32_t* query_pairs, const uint32_t* keys, int64_t blocks, int64_t k_chunks,
                     float* scores, int64_t width) {
    for (int64_t b = 0; b < blocks; ++b) {
      __m512 sum[16];
      for (int m = 0; m < 16; ++m) sum[m] = _mm512_setzero_ps();
      const uint32_t* block = keys + b * k_chunks * 256;
      for (int64_t p = 0; p < k_chunks * 16; ++p) {  // dimension pair p: one row of the block
        const __m512bh key_pairs = (__m512bh)_mm512_loadu_si512(block + p * 16);
        const uint32_t* q = query_pairs + p * 16;
        for (int m = 0; m < 16; ++m) sum[m] = _mm512_dpbf16_ps(sum[m], (__m512bh)_mm512_set1_epi32(q[m]), key_pairs);
      }
      for (int m = 0; m < 16; ++m) _mm512_storeu_ps(scores + m * width + 16 * b, sum[m]);
    }
  }
  static void values(const uint32_t* weight_pairs, const uint32_t* values, int64_t position_blocks,
                     int64_t v_chunks, float* sums, int64_t dims) {
    for (int64_t c = 0; c < v_chunks; ++c) {
      __m512 sum[16];
      for (int m = 0; m < 16; ++m) sum[m] = _mm512_setzero_ps();
      for (int64_t b = 0; b < position_blocks; ++b) {
        const uint32_t* block = values + (b * v_chunks + c) * 256;
        const uint32_t* w = weight_pairs + b * 256;  // position pairs 16b .. 16b + 15
        for (int64_t j = 0; j < 16; ++j) {
          const __m512bh value_pairs = (__m512bh)_mm512_loadu_si512(block + j * 16);
          for (int m = 0; m < 16; ++m) {
            sum[m] = _mm512_dpbf16_ps(sum[m], (__m512bh)_mm512_set1_epi32(w[j * 16 + m]), value_pairs);
          }
        }
      }
      for (int m = 0; m < 16; ++m) _mm512_storeu_ps(sums + m * dims + 16 * c, sum[m]);
    }
  }
};

// Attention of sequence `seq`'s query tokens for KV head `kv` and its group of query heads.
template <typename Products>
void tile_attention_task(const DecodeLayout<at::BFloat16>& shape, const int32_t* starts, int64_t seq, int64_t kv,
                         float scale, int64_t out_stride_seq, int64_t out_stride_head, TileAttentionScratch& s) {
  using bf16 = at::BFloat16;
  const int64_t dims = shape.head_dim, len = shape.lens[seq];
  const int64_t q_first = starts[seq], q_len = starts[seq + 1] - q_first, first_position = len - q_len;
  const int64_t key_blocks = (len + 15) / 16, width = (len + 31) / 32 * 32;
  const int64_t k_chunks = dims / 32, v_chunks = dims / 16;
  const int32_t* table = shape.tables + seq * shape.table_width;
  auto row_at = [&](const bf16* cache, int64_t pos) {
    return cache + static_cast<int64_t>(table[pos / shape.block_size]) * shape.kv_stride_block +
           (pos % shape.block_size) * shape.kv_stride_slot + kv * shape.kv_stride_head;
  };
  // Keys: block (b, c) row r holds the pair of dimensions (32c + 2r, 32c + 2r + 1) of keys
  // 16b..16b+15 (zeros past the last key). The rows are read a block ahead of their
  // transposition, so the reads do not wait on memory one after another.
  s.keys.resize(key_blocks * k_chunks * 256);
  auto prefetch_rows = [&](const bf16* cache, int64_t first, int64_t count) {
    for (int64_t pos = first, e = std::min(len, first + count); pos < e; ++pos) {
      const char* row = reinterpret_cast<const char*>(row_at(cache, pos));
      for (int64_t offset = 0; offset < dims * 2; offset += kCacheLine) __builtin_prefetch(row + offset);
    }
  };
  prefetch_rows(shape.k_ptr, 0, 16);
  for (int64_t b = 0; b < key_blocks; ++b) {
    prefetch_rows(shape.k_ptr, 16 * (b + 1), 16);
    prefetch_rows(shape.v_ptr, 16 * b, 16);
    const uint32_t* rows[16];
    const int64_t count = std::min<int64_t>(16, len - 16 * b);
    for (int64_t i = 0; i < count; ++i) rows[i] = reinterpret_cast<const uint32_t*>(row_at(shape.k_ptr, 16 * b + i));
    for (int64_t c = 0; c < k_chunks; ++c) {
      __m512i words[16];
      for (int64_t i = 0; i < 16; ++i) words[i] = i < count ? _mm512_loadu_si512(rows[i] + 16 * c) : _mm512_setzero_si512();
      transpose_words(words);
      uint32_t* block = s.keys.data() + (b * k_chunks + c) * 256;
      for (int64_t r = 0; r < 16; ++r) _mm512_storeu_si512(block + 16 * r, words[r]);
    }
  }
  // Values: block (b, c) row j holds positions 32b + 2j and 32b + 2j + 1 of dimensions
  // 16c..16c+15, interleaved (one position's dimension, the other's, the next dimension...).
  s.values.assign(width / 32 * v_chunks * 256, 0u);
  for (int64_t pos = 0; pos < len; pos += 2) {
    const bf16* even = row_at(shape.v_ptr, pos);
    const bf16* odd = pos + 1 < len ? row_at(shape.v_ptr, pos + 1) : nullptr;
    uint32_t* row = s.values.data() + (pos / 32) * v_chunks * 256 + ((pos % 32) / 2) * 16;
    for (int64_t c = 0; c < v_chunks; c += 2) {  // 32 dimensions, two blocks' rows, at a time
      const __m512i a = _mm512_loadu_si512(even + 16 * c);
      const __m512i b = odd != nullptr ? _mm512_loadu_si512(odd + 16 * c) : _mm512_setzero_si512();
      __m512i low, high;
      interleave_positions(a, b, low, high);
      _mm512_storeu_si512(row + c * 256, low);
      _mm512_storeu_si512(row + (c + 1) * 256, high);
    }
  }
  s.scores.resize(16 * width);
  s.weights.resize(16 * width);
  s.query.resize(16 * dims);
  s.sums.resize(16 * dims);
  auto* query_pairs = reinterpret_cast<uint32_t*>(s.query.data());
  auto* weight_pairs = reinterpret_cast<uint32_t*>(s.weights.data());
  float inverse[16];
  const __m512 vscale = _mm512_set1_ps(scale);
  const int64_t group_bytes = shape.group * dims * 2;
  auto prefetch_queries = [&](int64_t t0) {
    for (int64_t m = t0, e = std::min(q_len, t0 + 16); m < e; ++m) {
      const char* row = reinterpret_cast<const char*>(shape.q_ptr + (q_first + m) * shape.q_stride_seq +
                                                      kv * shape.group * shape.q_stride_head);
      for (int64_t offset = 0; offset < group_bytes; offset += kCacheLine) __builtin_prefetch(row + offset);
    }
  };
  prefetch_queries(0);
  for (int64_t t0 = 0; t0 < q_len; t0 += 16) {
    prefetch_queries(t0 + 16);
    const int64_t rows = std::min<int64_t>(16, q_len - t0);
    for (int64_t g = 0; g < shape.group; ++g) {
      const int64_t head = kv * shape.group + g;
      const bf16* q_rows = shape.q_ptr + (q_first + t0) * shape.q_stride_seq + head * shape.q_stride_head;
      // Row m sees positions [0, first_position + t0 + m]; the tile's keys end at `seen`.
      const int64_t seen = first_position + t0 + rows, blocks = (seen + 15) / 16, seen_width = (seen + 31) / 32 * 32;
      if constexpr (Products::kPairMajor) {
        // The tile's query rows pair-major, rows past the chunk's end zero.
        for (int64_t c = 0; c < k_chunks; ++c) {
          __m512i words[16];
          for (int64_t m = 0; m < 16; ++m) {
            words[m] = m < rows ? _mm512_loadu_si512(q_rows + m * shape.q_stride_seq + 32 * c) : _mm512_setzero_si512();
          }
          transpose_words(words);
          for (int64_t r = 0; r < 16; ++r) _mm512_storeu_si512(query_pairs + (16 * c + r) * 16, words[r]);
        }
        Products::scores(query_pairs, s.keys.data(), blocks, k_chunks, s.scores.data(), width);
      } else {
        // The tile's query rows: read in place when there are 16 (a row every q_stride_seq),
        // else from a copy padded with zeros.
        int64_t q_stride = shape.q_stride_seq * 2;
        if (rows < 16 || shape.q_stride_head != dims) {
          for (int64_t m = 0; m < 16; ++m) {
            bf16* dst = s.query.data() + m * dims;
            if (m < rows) {
              std::memcpy(dst, q_rows + m * shape.q_stride_seq, dims * 2);
            } else {
              std::memset(dst, 0, dims * 2);
            }
          }
          q_rows = s.query.data();
          q_stride = dims * 2;
        }
        Products::scores(q_rows, q_stride, s.keys.data(), blocks, k_chunks, s.scores.data(), width);
      }
      // Each row's softmax; its weights, rounded to bfloat16, zero past what it sees.
      for (int64_t m = 0; m < 16; ++m) {
        const int64_t limit = m < rows ? first_position + t0 + m + 1 : 1;
        float* sc = s.scores.data() + m * width;
        __m512 peak = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        for (int64_t p = 0; p < limit; p += 16) {
          const __mmask16 mask = first_lanes(limit - p);
          const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, sc + p), vscale);
          _mm512_mask_storeu_ps(sc + p, mask, x);
          peak = _mm512_mask_max_ps(peak, mask, peak, x);
        }
        const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(peak));
        __m512 total = _mm512_setzero_ps();
        for (int64_t p = 0; p < seen_width; p += 16) {
          __m256i w = _mm256_setzero_si256();
          if (p < limit) {
            const __mmask16 mask = first_lanes(limit - p);
            const __m512 e = _mm512_maskz_mov_ps(mask, exp_lanes(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, sc + p), top)));
            total = _mm512_add_ps(total, e);
            w = (__m256i)_mm512_cvtneps_pbh(e);
          }
          if constexpr (Products::kPairMajor) {
            alignas(32) uint32_t words[8];
            _mm256_store_si256(reinterpret_cast<__m256i*>(words), w);
            for (int64_t i = 0; i < 8; ++i) weight_pairs[(p / 2 + i) * 16 + m] = words[i];
          } else {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(s.weights.data() + m * width + p), w);
          }
        }
        inverse[m] = 1.0f / _mm512_reduce_add_ps(total);
      }
      if constexpr (Products::kPairMajor) {
        Products::values(weight_pairs, s.values.data(), seen_width / 32, v_chunks, s.sums.data(), dims);
      } else {
        Products::values(s.weights.data(), width, s.values.data(), seen_width / 32, v_chunks, s.sums.data(), dims);
      }
      for (int64_t m = 0; m < rows; ++m) {
        bf16* o = shape.out_ptr + (q_first + t0 + m) * out_stride_seq + head * out_stride_head;
        const __m512 inv = _mm512_set1_ps(inverse[m]);
        for (int64_t d = 0; d < dims; d += 16) {
          const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s.sums.data() + m * dims + d), inv);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d), (__m256i)_mm512_cvtneps_pbh(x));
        }
      }
    }
  }
}

template <typename Products>
void tile_attention_with(const DecodeLayout<at::BFloat16>& shape, const int32_t* starts,
                         const std::vector<int64_t>& seqs, double scale, const at::Tensor& out) {
  const int64_t heads = shape.num_kv_heads;
  at::parallel_for(0, static_cast<int64_t>(seqs.size()) * heads, 1, [&](int64_t begin, int64_t end) {
    Products::begin();
    thread_local TileAttentionScratch scratch;
    for (int64_t task = begin; task < end; ++task) {
      tile_attention_task<Products>(shape, starts, seqs[task / heads], task % heads, static_cast<float>(scale),
                                    out.stride(0), out.stride(1), scratch);
    }
    Products::end();
  });
}

// Which products the tiled prefill attention runs here: "amx", "vector", or "" where the
// switch is off.
std::string tile_attention_kind() {
  if (!tile_attention_enabled) return "";
#ifdef CADENCE_AMX
  if (amx_permitted()) return "amx";
#endif
  return "vector";
}

// The sequences `seqs` (each of at least kTileQueryRows query tokens), every KV head a task.
void tile_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_tables, const at::Tensor& seq_lens, const int32_t* starts,
                    const std::vector<int64_t>& seqs, double scale, at::Tensor& out) {
  const DecodeLayout<at::BFloat16> shape(query, k_cache, v_cache, block_tables, seq_lens, out);
#ifdef CADENCE_AMX
  if (amx_permitted()) {
    tile_attention_with<AmxProducts>(shape, starts, seqs, scale, out);
    return;
  }
#endif
  tile_attention_with<VectorProducts>(shape, starts, seqs, scale, out);
}
#endif

// Causal attention of a step's query tokens over their sequences' caches, decodes and
// prefill chunks alike: sequence s's tokens are rows [query_start[s], query_start[s + 1])
// of query [N, num_heads, head_dim], the last at position seq_lens[s] - 1 (its earlier
// positions, cached or new, are in the cache already). query_start [num_seqs + 1] int32.
// Bfloat16 chunks of at least kTileQueryRows tokens are attended in tiles (where the
// head size is a multiple of 32), the rest by the vector kernel.
at::Tensor paged_attention(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
                           at::Tensor block_tables, at::Tensor seq_lens, at::Tensor query_start,
                           double scale) {
  check_attention(query, k_cache, v_cache, block_tables, seq_lens);
  TORCH_CHECK(query_start.scalar_type() == at::kInt && query_start.numel() == seq_lens.numel() + 1,
              "query_start must be int32 [num_seqs + 1]");
  auto out = at::empty_like(query);
#ifdef CADENCE_AVX512
  if (AttentionFn fast = vector_kernel_for(query.scalar_type(), query.size(2))) {
    auto starts = query_start.contiguous();
    auto tables = block_tables.contiguous();
    auto lengths = seq_lens.contiguous();
    const int32_t* s = starts.data_ptr<int32_t>();
    const int32_t* lens = lengths.data_ptr<int32_t>();
    const int64_t num_seqs = seq_lens.numel();
    TORCH_CHECK(s[0] == 0 && s[num_seqs] == query.size(0), "query_start must cover the query rows");
    for (int64_t i = 0; i < num_seqs; ++i) {
      TORCH_CHECK(s[i + 1] > s[i] && lens[i] >= s[i + 1] - s[i], "sequence ", i, " has no query or too short a context");
    }
#ifdef __AVX512BF16__
    if (tile_attention_enabled && query.scalar_type() == at::kBFloat16 && query.size(2) % 32 == 0 &&
        query.size(0) >= kTileQueryRows) {
      std::vector<int64_t> tiled;
      std::vector<uint8_t> skip(num_seqs, 0);
      for (int64_t i = 0; i < num_seqs; ++i) {
        if (s[i + 1] - s[i] >= kTileQueryRows) {
          tiled.push_back(i);
          skip[i] = 1;
        }
      }
      if (!tiled.empty()) {
        tile_attention(query, k_cache, v_cache, tables, lengths, s, tiled, scale, out);
        if (tiled.size() < static_cast<size_t>(num_seqs)) {
          fast(query, k_cache, v_cache, tables, lengths, starts, scale, out, skip.data());
        }
        return out;
      }
    }
#endif
    fast(query, k_cache, v_cache, tables, lengths, starts, scale, out, nullptr);
    return out;
  }
#endif
  TORCH_CHECK(false, "paged_attention has no kernel for this dtype and head size here (has_paged_attention)");
  return out;
}

// ---- the decoder stack of a step, in one call ------------------------------------------
//
// A step of a small model spends as long in Python, between torch's ops, as in the
// products themselves: about forty calls a layer, each taking the interpreter's lock
// back, which a server's own thread holds while it reads requests and streams tokens
// (a 128-token prefill of the demo model took 23 ms beside a busy server against its
// 10 ms of work). DecodeStack runs the same ops in the same order from C++ (the
// prepacked products, through oneDNN's linear or `small_product`, these kernels, and
// torch's silu and mul) with the lock released, so its results are bit for bit the
// Python path's. The one change of order: each layer's closing residual add is done by
// the next norm (`rms_norm` with a residual rounds the sum as torch's add would), and the
// last by the final norm. A decode step's attention rows are its sequences; a step with
// prompts passes each query row's own block table and context length (the form
// `paged_decode_attention` takes for any row) or, where `paged_attention` takes the
// query (AVX-512), each sequence's table, length and first query row as that kernel
// does; and the rows that sample, which alone run the last layer past its attention,
// as the Python path's `keep`. A server's mixed steps (a prompt beside the decodes)
// are then one call too: each took the lock back some 500 times.

// x times a prepacked weight: `small` where given, for at most product_rows rows or where
// oneDNN's `weight` is not kept; else oneDNN's.
at::Tensor packed_linear(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                         const c10::optional<at::Tensor>& small, const c10::optional<at::Tensor>& bias,
                         int64_t out_features) {
  if (small.has_value() && (x.size(0) <= product_rows(x.scalar_type(), out_features, x.size(1)) ||
                            !weight.has_value())) {
    return small_product(x, *small, bias, out_features);
  }
  TORCH_CHECK(weight.has_value(), "a product needs a prepacked weight");
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                                         c10::string_view, c10::List<c10::optional<at::Scalar>>,
                                         c10::optional<c10::string_view>)>();
  return op.call(x, *weight, bias, "none", c10::List<c10::optional<at::Scalar>>(), c10::string_view(""));
}

// The key and value rows [T, num_kv_heads, head_dim] (each token's heads side by side)
// stored at their cache slots.
void store_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  const int64_t tokens = key.size(0), row_bytes = key.size(1) * key.size(2) * key.element_size();
  const int64_t slot_bytes = k_cache.stride(1) * k_cache.element_size();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  char* k_base = static_cast<char*>(k_cache.data_ptr());
  char* v_base = static_cast<char*>(v_cache.data_ptr());
  const int64_t cache_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < cache_slots, "slot ", slots[t], " outside the cache");
    std::memcpy(k_base + slots[t] * slot_bytes, static_cast<const char*>(key.data_ptr()) + t * key.stride(0) * key.element_size(), row_bytes);
    std::memcpy(v_base + slots[t] * slot_bytes, static_cast<const char*>(value.data_ptr()) + t * value.stride(0) * value.element_size(), row_bytes);
  }
}

struct DecodeStack {
  // Per layer: input norm weight, then for qkv: oneDNN's weight (or none), small-batch
  // weight (or none, not both), bias; the same for o; the post-attention norm weight;
  // the same three for gate_up and for down.
  std::vector<std::vector<c10::optional<at::Tensor>>> layers;
  at::Tensor final_norm;
  double eps, scale;
  int64_t num_heads, num_kv_heads, head_dim, intermediate;
  // The feed-forward block takes a longer run of rows this many at a time (0: all at
  // once), as the Python MLP's `chunk_rows`: each slice's [rows, 2 x intermediate]
  // product stays in the cache.
  int64_t chunk_rows;

  DecodeStack(std::vector<std::vector<c10::optional<at::Tensor>>> layers, at::Tensor final_norm, double eps,
              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, double scale,
              int64_t chunk_rows)
      : layers(std::move(layers)), final_norm(std::move(final_norm)), eps(eps), scale(scale), num_heads(num_heads),
        num_kv_heads(num_kv_heads), head_dim(head_dim), intermediate(intermediate), chunk_rows(chunk_rows) {
    for (const auto& layer : this->layers) TORCH_CHECK(layer.size() == 14, "a layer takes 14 tensors");
  }

  // down(silu(gate) * up) of rows x, `chunk_rows` at a time where there are more.
  at::Tensor feed_forward(const at::Tensor& x, const std::vector<c10::optional<at::Tensor>>& w,
                          int64_t out_features) const {
    auto block = [&](const at::Tensor& rows) {
      at::Tensor gate_up = packed_linear(rows, w[8], w[9], w[10], 2 * intermediate);
      auto halves = gate_up.chunk(2, -1);
      return packed_linear(silu_mul(halves[0], halves[1]), w[11], w[12], w[13], out_features);
    };
    const int64_t rows = x.size(0);
    if (chunk_rows <= 0 || rows <= chunk_rows) return block(x);
    at::Tensor out = at::empty({rows, out_features}, x.options());
    for (int64_t first = 0; first < rows; first += chunk_rows) {
      const int64_t n = std::min(chunk_rows, rows - first);
      out.narrow(0, first, n).copy_(block(x.narrow(0, first, n)));
    }
    return out;
  }

  // hidden [T, hidden] (the embedded tokens), cos/sin [T, head_dim], caches: each
  // layer's key then value cache; block_tables [T, width] and seq_lens [T]: each query
  // row's table and context length, or with `query_start` [S + 1] (int32) each of S
  // sequences' (`paged_attention`'s form: sequence s's rows [query_start[s],
  // query_start[s + 1]) end at position seq_lens[s] - 1). Returns the final norm's
  // output [T, hidden], or with `keep_rows` that of those rows only: the last layer
  // attends for them alone (their tables and lengths `keep_tables` and `keep_lens`),
  // every row's key and value stored all the same.
  at::Tensor forward(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                     std::vector<at::Tensor> caches, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const c10::optional<at::Tensor>& keep_rows,
                     const c10::optional<at::Tensor>& keep_tables, const c10::optional<at::Tensor>& keep_lens,
                     const c10::optional<at::Tensor>& query_start) const {
    TORCH_CHECK(caches.size() == 2 * layers.size(), "two caches a layer");
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping: int64");
    TORCH_CHECK(keep_rows.has_value() == keep_tables.has_value() && keep_rows.has_value() == keep_lens.has_value(),
                "keep_rows, keep_tables and keep_lens come together");
    const int64_t tokens = hidden.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    at::Tensor x = hidden, residual;
    for (size_t i = 0; i < layers.size(); ++i) {
      const auto& w = layers[i];
      at::Tensor normed;
      if (i == 0) {
        normed = rms_norm(x.contiguous(), *w[0], eps, c10::nullopt)[0];
        residual = x;
      } else {
        auto both = rms_norm(x, *w[0], eps, residual);
        normed = both[0];
        residual = both[1];
      }
      at::Tensor qkv = packed_linear(normed, w[1], w[2], w[3], q_size + 2 * kv_size);
      at::Tensor q = rotated(qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim}), cos, sin);
      at::Tensor k = rotated(qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim}), cos, sin);
      at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
      store_kv(k, v, caches[2 * i], caches[2 * i + 1], slot_mapping);
      at::Tensor tables = block_tables, lens = seq_lens;
      bool by_sequence = query_start.has_value();
      if (keep_rows.has_value() && i + 1 == layers.size()) {  // the last layer: the kept rows alone
        const at::Tensor kept = keep_rows->to(at::kLong);
        if (kept.size(0) == 0) return hidden.new_empty({0, hidden.size(1)});
        q = q.index_select(0, kept);
        residual = residual.index_select(0, kept);
        tables = *keep_tables;
        lens = *keep_lens;
        by_sequence = false;  // each kept row a one-token query over its whole context
      }
      const int64_t rows = q.size(0);
      at::Tensor attended =
          by_sequence ? paged_attention(q, caches[2 * i], caches[2 * i + 1], tables, lens, *query_start, scale)
                      : paged_decode_attention(q, caches[2 * i], caches[2 * i + 1], tables, lens, scale);
      at::Tensor out = packed_linear(attended.view({rows, q_size}), w[4], w[5], w[6], hidden.size(1));
      auto both = rms_norm(out, *w[7], eps, residual);
      residual = both[1];
      x = feed_forward(both[0], w, hidden.size(1));
    }
    return rms_norm(x, final_norm, eps, residual)[0];
  }
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels run without the GIL, as torch's own ops do: the engine's event loop
  // keeps running while the model thread is in one.
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache",
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_attention", &paged_attention, "causal attention of decodes and prefills over a paged KV cache",
        py::call_guard<py::gil_scoped_release>());
  m.def("has_paged_attention", &has_paged_attention, "whether paged_attention takes this dtype and head size");
  m.def("has_row_attention", &has_row_attention,
        "whether paged_decode_attention has a vector kernel for this dtype and head size");
  m.def("rms_norm", &rms_norm, "RMSNorm of rows, optionally of residual + x",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("rotary", &rotary, "rotary embedding in place, rotate-half layout",
        py::call_guard<py::gil_scoped_release>());
  m.def("rotated", &rotated, "rotary embedding into a new contiguous tensor",
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, "silu(gate) * up of [T, I] rows", py::call_guard<py::gil_scoped_release>());
  m.def("store_kv", &store_kv, "key and value rows stored at their cache slots",
        py::call_guard<py::gil_scoped_release>());
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<std::vector<std::vector<c10::optional<at::Tensor>>>, at::Tensor, double, int64_t, int64_t, int64_t,
                    int64_t, double, int64_t>())
      .def("forward", &DecodeStack::forward, "the decoder stack of a step",
           py::arg("hidden"), py::arg("cos"), py::arg("sin"), py::arg("caches"), py::arg("slot_mapping"),
           py::arg("block_tables"), py::arg("seq_lens"), py::arg("keep_rows") = py::none(),
           py::arg("keep_tables") = py::none(), py::arg("keep_lens") = py::none(),
           py::arg("query_start") = py::none(),
           py::call_guard<py::gil_scoped_release>());
  m.def("small_product", &small_product, "x [<= SMALL_ROWS, K] times a small-batch packed weight",
        py::call_guard<py::gil_scoped_release>());
  m.def("small_product_dtypes", &small_product_dtypes, "the dtypes small_product takes on this CPU");
  m.def("set_tile_attention", [](bool on) {
#ifdef __AVX512BF16__
    tile_attention_enabled = on;
#endif
    (void)on;
  }, "whether bfloat16 prefill chunks may attend in tiles of 16 query tokens (on by default; tests compare the kernels)");
  m.def("tile_attention_kind", [] {
#ifdef __AVX512BF16__
    return tile_attention_kind();
#else
    return std::string();
#endif
  }, "the products bfloat16 prefill chunks attend with here: 'amx', 'vector', or '' (none, or switched off)");
  m.def("tile_products", [] {
#ifdef CADENCE_AMX
    return amx_permitted();
#else
    return false;
#endif
  }, "whether bfloat16 small products run on AMX tiles here (inputs a multiple of 32)");
  m.attr("SMALL_ROWS") = kProductRows;
  m.def("product_rows", [](const std::string& dtype, int64_t out_features, int64_t in_features) {
    return product_rows(dtype == "bfloat16" ? at::kBFloat16 : at::kFloat, out_features, in_features);
  }, "the most rows a product of this dtype takes on the small-batch path beside oneDNN's copy");
  m.attr("SMALL_COLUMNS") = kSmallColumns;
  m.def("argmax", &argmax, "torch.argmax(x, dim=-1) of rows", py::call_guard<py::gil_scoped_release>());
}
