// Decode attention over the paged KV cache for the CPU, reading each block in place.
//
// Tasks are sequences (or, when there are too few to share out, single KV heads),
// spread over torch's OpenMP threads. A task loads its query heads once, scores
// every context position against them (each key is read once for its whole group
// of query heads), takes the softmax in float32 and accumulates the values, again
// one read per position. Keys and values are read straight from their cache
// blocks through the block table, slot after slot, so no per-step copy of the
// context is made and each block's memory is swept front to back.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(double x) { return static_cast<float>(x); }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float to_float(at::Half x) { return static_cast<float>(x); }

template <typename scalar_t>
inline void load_row(const scalar_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// Positions one block ahead are prefetched: blocks lie anywhere in the cache, so the
// hardware's stream prefetcher loses its stream at every block boundary.
constexpr int64_t kCacheLine = 64;

template <typename scalar_t>
void decode_attention(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                      const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale,
                      torch::Tensor& out) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t table_width = block_tables.size(1);
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t q_stride_seq = query.stride(0), q_stride_head = query.stride(1);
  const int64_t kv_stride_block = k_cache.stride(0), kv_stride_slot = k_cache.stride(1);
  const int64_t kv_stride_head = k_cache.stride(2);
  const float fscale = static_cast<float>(scale);
  // A task is a sequence's KV heads [first, first + heads_per_task): whole sequences when
  // there are enough to keep every thread busy, so that each task sweeps its blocks'
  // memory front to back (one slot holds every head), else single heads.
  const int64_t heads_per_task = num_seqs >= 4 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t tasks_per_seq = num_kv_heads / heads_per_task;
  const int64_t task_bytes = ((heads_per_task - 1) * kv_stride_head + head_dim) * sizeof(scalar_t);

  at::parallel_for(0, num_seqs * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    const int64_t rows = heads_per_task * group;
    std::vector<float> q(rows * head_dim), acc(rows * head_dim), row(head_dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / tasks_per_seq, first_kv = (task % tasks_per_seq) * heads_per_task;
      const int64_t len = lens[seq];
      const int32_t* table = tables + seq * table_width;
      // Where position `pos` of this task's first KV head lives in a cache.
      auto slot_at = [&](const scalar_t* cache, int64_t pos) {
        return cache + static_cast<int64_t>(table[pos / block_size]) * kv_stride_block +
               (pos % block_size) * kv_stride_slot;
      };
      auto prefetch = [&](const scalar_t* slot) {
        const char* first = reinterpret_cast<const char*>(slot + first_kv * kv_stride_head);
        for (int64_t offset = 0; offset < task_bytes; offset += kCacheLine) __builtin_prefetch(first + offset);
      };
      for (int64_t r = 0; r < rows; ++r) {
        load_row(q_ptr + seq * q_stride_seq + (first_kv * group + r) * q_stride_head, q.data() + r * head_dim,
                 head_dim);
      }
      scores.resize(rows * len);
      for (int64_t pos = 0; pos < len; ++pos) {
        const scalar_t* slot = slot_at(k_ptr, pos);
        if (pos + block_size < len) prefetch(slot_at(k_ptr, pos + block_size));
        for (int64_t h = 0; h < heads_per_task; ++h) {
          load_row(slot + (first_kv + h) * kv_stride_head, row.data(), head_dim);
          for (int64_t g = 0; g < group; ++g) {
            const float* qr = q.data() + (h * group + g) * head_dim;
            float dot = 0.0f;
            for (int64_t d = 0; d < head_dim; ++d) dot += qr[d] * row[d];
            scores[(h * group + g) * len + pos] = dot * fscale;
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* s = scores.data() + r * len;
        const float peak = *std::max_element(s, s + len);
        float total = 0.0f;
        for (int64_t pos = 0; pos < len; ++pos) {
          s[pos] = std::exp(s[pos] - peak);
          total += s[pos];
        }
        const float inverse = 1.0f / total;
        for (int64_t pos = 0; pos < len; ++pos) s[pos] *= inverse;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t pos = 0; pos < len; ++pos) {
        const scalar_t* slot = slot_at(v_ptr, pos);
        if (pos + block_size < len) prefetch(slot_at(v_ptr, pos + block_size));
        for (int64_t h = 0; h < heads_per_task; ++h) {
          load_row(slot + (first_kv + h) * kv_stride_head, row.data(), head_dim);
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[(h * group + g) * len + pos];
            float* a = acc.data() + (h * group + g) * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * row[d];
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        scalar_t* o = out_ptr + seq * out.stride(0) + (first_kv * group + r) * out.stride(1);
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<scalar_t>(acc[r * head_dim + d]);
      }
    }
  });
}

}  // namespace

// query [num_seqs, num_heads, head_dim] (one token per sequence); caches
// [num_blocks, block_size, num_kv_heads, head_dim]; block_tables [num_seqs, width]
// int32; seq_lens [num_seqs] int32, each >= 1. Returns [num_seqs, num_heads, head_dim].
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(query.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "head dimension must be contiguous");
  TORCH_CHECK(k_cache.strides() == v_cache.strides(), "key and value caches must share a layout");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "query and caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, query.scalar_type(),
                                  "paged_decode_attention", [&] {
    decode_attention<scalar_t>(query, k_cache, v_cache, tables, lens, scale, out);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache");
}
