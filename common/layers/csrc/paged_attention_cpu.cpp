// Decode attention over a paged KV cache, on the CPU, reading the blocks in
// place (ch04). Python side, reference and tests: common/layers/cpu_attention.py.
//
// One query token per sequence; sequence s's token t sits in cache block
// block_tables[s][t / block_size], row t % block_size, and a row holds the
// K (or V) of every KV head. The sequences are spread over the intra-op
// threads. Each walks its context a tile at a time (up to kTile consecutive
// tokens of one block: contiguous memory), with an online softmax, in float32:
//   1. the tile's K rows -> scores of every query head, scaled;
//   2. the running maximum and sum of exp(score - max), rescaling what was
//      summed so far when the maximum grows (as flash attention does);
//   3. the tile's V rows, weighted by exp(score - max), added to the output.
// Every K and V row is read once, where it is; a KV head's row serves the
// query heads of its group (grouped-query attention). While a tile is being
// computed, the next one's rows are prefetched: the blocks are scattered, so
// the hardware cannot guess where the next one is (1.2x at 180 tokens).
// head_dim 64 and 128 are compiled as constants (the loops unroll, q and the
// output stay in registers); other sizes take the generic version.
//
// Left out: long prefill chunks (several query tokens: common/layers/cpu_attention.py
// sends short chunks here as decode rows, longer ones to the PyTorch reference),
// explicit SIMD intrinsics (the compiler vectorizes the loops over head_dim),
// splitting one long context over several threads (vLLM's "split-K").
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kTile = 32;  // tokens per tile, at most (fewer at a block's end)

// One value to float32. bfloat16 is float32's upper 16 bits: a shift,
// written on the bits so that the compiler vectorizes the loops around it.
template <typename scalar_t>
inline float f32(scalar_t x) { return static_cast<float>(x); }
inline float f32(c10::BFloat16 x) { return __builtin_bit_cast(float, uint32_t(x.x) << 16); }

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t group() const { return num_heads / num_kv_heads; }  // query heads per KV head
  int64_t row() const { return num_kv_heads * head_dim; }     // one token's K (or V)
};

// One sequence: out (num_heads, head_dim) from q (num_heads, head_dim).
// kHeadDim: head_dim known at compile time, or 0 (read from `shape`).
template <typename scalar_t, int64_t kHeadDim>
struct DecodeOne {
  const Shape& shape;
  std::vector<float> q, acc, scores, running_max, total;

  explicit DecodeOne(const Shape& s)
      : shape(s), q(s.num_heads * s.head_dim), acc(s.num_heads * s.head_dim),
        scores(s.num_heads * kTile), running_max(s.num_heads),
        total(s.num_heads) {}

  void run(const scalar_t* query, const scalar_t* k_cache, const scalar_t* v_cache,
           const int32_t* blocks, int64_t context_len, float scale, scalar_t* out) {
    const int64_t H = shape.num_heads, D = shape.head_dim, bs = shape.block_size;
    for (int64_t i = 0; i < H * D; ++i) q[i] = f32(query[i]);
    std::fill(acc.begin(), acc.end(), 0.f);
    std::fill(running_max.begin(), running_max.end(), -std::numeric_limits<float>::infinity());
    std::fill(total.begin(), total.end(), 0.f);
    for (int64_t start = 0; start < context_len;) {
      const int64_t offset = start % bs;
      const int64_t n = std::min({kTile, bs - offset, context_len - start});
      const int64_t slot = int64_t(blocks[start / bs]) * bs + offset;  // the tile's first
      if (start + n < context_len) {  // the next tile's rows, on their way during this one
        const int64_t next = start + n;
        const int64_t next_slot = int64_t(blocks[next / bs]) * bs + next % bs;
        const int64_t next_n = std::min({kTile, bs - next % bs, context_len - next});
        const char* nk = reinterpret_cast<const char*>(k_cache + next_slot * shape.row());
        const char* nv = reinterpret_cast<const char*>(v_cache + next_slot * shape.row());
        for (int64_t byte = 0; byte < next_n * shape.row() * int64_t(sizeof(scalar_t)); byte += 64) {
          __builtin_prefetch(nk + byte);
          __builtin_prefetch(nv + byte);
        }
      }
      for (int64_t h = 0; h < H; ++h) score_tile(k_cache + slot * shape.row(), h, n, scale);
      for (int64_t h = 0; h < H; ++h) add_values(v_cache + slot * shape.row(), h, n);
      start += n;
    }
    for (int64_t h = 0; h < H; ++h) {
      const float inv = 1.f / total[h];
      for (int64_t d = 0; d < D; ++d)
        out[h * D + d] = static_cast<scalar_t>(acc[h * D + d] * inv);
    }
  }

  // Steps 1-2 for query head h: scores[h][i] = exp(q_h . k_i * scale - max).
  void score_tile(const scalar_t* tile, int64_t h, int64_t n, float scale) {
    const int64_t D = kHeadDim ? kHeadDim : shape.head_dim;
    const float* __restrict__ qh = &q[h * D];
    const scalar_t* __restrict__ k = tile + (h / shape.group()) * D;  // this head's KV head, token 0
    float* __restrict__ s = &scores[h * kTile];
    for (int64_t i = 0; i < n; ++i) {
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qh[d] * f32(k[i * shape.row() + d]);
      s[i] = dot * scale;
    }
    const float tile_max = *std::max_element(s, s + n);
    if (tile_max > running_max[h]) {  // rescale what was summed under the old maximum
      const float correction = std::exp(running_max[h] - tile_max);
      total[h] *= correction;
      float* a = &acc[h * D];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] *= correction;
      running_max[h] = tile_max;
    }
    float tile_total = 0.f;
#pragma omp simd reduction(+ : tile_total)
    for (int64_t i = 0; i < n; ++i) tile_total += (s[i] = std::exp(s[i] - running_max[h]));
    total[h] += tile_total;
  }

  // Step 3 for query head h: acc_h += sum_i scores[h][i] * v_i.
  void add_values(const scalar_t* tile, int64_t h, int64_t n) {
    const int64_t D = kHeadDim ? kHeadDim : shape.head_dim;
    const scalar_t* __restrict__ v = tile + (h / shape.group()) * D;
    const float* __restrict__ s = &scores[h * kTile];
    float* __restrict__ a = &acc[h * D];
    for (int64_t i = 0; i < n; ++i) {
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += s[i] * f32(v[i * shape.row() + d]);
    }
  }
};

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4, "query (S, H, D), cache (N, B, H_kv, D)");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the cache must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 &&
              context_lens.scalar_type() == torch::kInt32, "block tables, lengths: int32");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "query heads: a multiple of KV heads");
  query = query.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  auto out = torch::empty_like(query);
  const Shape shape{query.size(1), k_cache.size(2), query.size(2), k_cache.size(1),
                    block_tables.size(1)};
  const int64_t per_seq = shape.num_heads * shape.head_dim;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "decode", [&] {
    const scalar_t* q = query.data_ptr<scalar_t>();
    const scalar_t* k = k_cache.data_ptr<scalar_t>();
    const scalar_t* v = v_cache.data_ptr<scalar_t>();
    const int32_t* tables = block_tables.data_ptr<int32_t>();
    const int32_t* lens = context_lens.data_ptr<int32_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    auto launch = [&](auto head_dim) {
      at::parallel_for(0, query.size(0), 1, [&](int64_t begin, int64_t end) {
        DecodeOne<scalar_t, decltype(head_dim)::value> one(shape);  // this thread's buffers
        for (int64_t s = begin; s < end; ++s)
          one.run(q + s * per_seq, k, v, tables + s * shape.max_blocks, lens[s],
                  static_cast<float>(scale), o + s * per_seq);
      });
    };
    if (shape.head_dim == 64) launch(std::integral_constant<int64_t, 64>());
    else if (shape.head_dim == 128) launch(std::integral_constant<int64_t, 128>());
    else launch(std::integral_constant<int64_t, 0>());
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention reading the paged KV cache in place (CPU)");
}
