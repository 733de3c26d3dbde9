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

// Round a float to bfloat16 (nearest, ties to even) and back, as torch's bfloat16 ops store results.
inline float round_bfloat16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
template <typename scalar_t>
inline float stored(float x) { return static_cast<float>(static_cast<scalar_t>(x)); }

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

std::vector<torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                    c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm needs contiguous inputs");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must share a dtype");
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  auto out = torch::empty_like(x);
  torch::Tensor total;
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() &&
                residual->scalar_type() == x.scalar_type(), "residual must match x");
    total = torch::empty_like(x);
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
void rotate_rows(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  const int64_t stride_token = x.stride(0), stride_head = x.stride(1);
  scalar_t* base = x.data_ptr<scalar_t>();
  const scalar_t* c = cos.data_ptr<scalar_t>();
  const scalar_t* s = sin.data_ptr<scalar_t>();
  const int64_t table = cos.stride(0);
  at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* ct = c + t * table;
      const scalar_t* st = s + t * table;
      for (int64_t h = 0; h < heads; ++h) {
        scalar_t* row = base + t * stride_token + h * stride_head;
        for (int64_t i = 0; i < half; ++i) {
          const float a = to_float(row[i]), b = to_float(row[i + half]);
          const float first = stored<scalar_t>(stored<scalar_t>(a * to_float(ct[i])) +
                                               stored<scalar_t>(-b * to_float(st[i])));
          const float second = stored<scalar_t>(stored<scalar_t>(b * to_float(ct[i + half])) +
                                                stored<scalar_t>(a * to_float(st[i + half])));
          row[i] = static_cast<scalar_t>(first);
          row[i + half] = static_cast<scalar_t>(second);
        }
      }
    }
  });
}

void rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary needs x [tokens, heads, head_dim], last dim contiguous");
  TORCH_CHECK(cos.dim() == 2 && cos.stride(1) == 1 && cos.sizes() == sin.sizes() && cos.strides() == sin.strides(),
              "cos and sin must be [tokens, head_dim]");
  TORCH_CHECK(cos.size(0) == x.size(0) && cos.size(1) == x.size(2), "cos and sin must match x");
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && cos.scalar_type() == sin.scalar_type(),
              "x, cos and sin must share a dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, x.scalar_type(), "rotary", [&] {
    rotate_rows<scalar_t>(x, cos, sin);
  });
}

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
  m.def("rms_norm", &rms_norm, "RMSNorm of rows, optionally of residual + x",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none());
  m.def("rotary", &rotary, "rotary embedding in place, rotate-half layout");
}
