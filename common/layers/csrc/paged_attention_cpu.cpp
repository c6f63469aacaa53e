// Decode attention over a paged KV cache, on the CPU, reading the blocks in
// place (ch04). Python side, reference and tests: common/layers/cpu_attention.py.
//
// One query token per sequence; sequence s's token t sits in cache block
// block_tables[s][t / block_size], row t % block_size, and a row holds the
// K (or V) of every KV head. The sequences go to the intra-op threads from
// one shared counter, the longest first. Where one context is more than a
// thread's share of the batch's keys, the contexts longer than kPiece tokens
// are cut into pieces of kPiece (flash-decoding's split), so that a few long
// contexts keep every core busy, not one. Each piece is walked a tile at a
// time (up to kTile consecutive tokens of one block: contiguous memory), with
// an online softmax, in float32:
//   1. the tile's K rows -> scores of every query head, scaled;
//   2. the running maximum and sum of exp(score - max), rescaling what was
//      summed so far when the maximum grows (as flash attention does);
//   3. the tile's V rows, weighted by exp(score - max), added to the output.
// A sequence cut into pieces then merges their partial results: each piece's
// sum is rescaled to the largest of the pieces' maxima (`merge_pieces`).
// Every K and V row is read once, where it is; a KV head's row serves the
// query heads of its group (grouped-query attention). While a tile is being
// computed, the next one's rows are prefetched: the blocks are scattered, so
// the hardware cannot guess where the next one is (1.2x at 180 tokens).
// For cascade attention (ch05), `paged_decode_attention_lse` also returns
// each head's log-sum-exp (max + log(sum)), and `merge_attn_states` joins
// the suffix's result with the shared prefix's.
// head_dim 64 and 128 are compiled as constants (the loops unroll, q and the
// output stay in registers); other sizes take the generic version.
//
// Left out: prefill chunks (several query tokens: prefill_attention_cpu.cpp),
// explicit SIMD intrinsics (the compiler vectorizes the loops over head_dim),
// a piece length that adapts to the batch (vLLM's CPU kernels pick theirs per ISA).
#include "cpu_vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using cpu_attention::f32;
using cpu_attention::run_tasks;

constexpr int64_t kTile = 32;    // tokens per tile, at most (fewer at a block's end)
constexpr int64_t kPiece = 512;  // a longer context is cut into pieces of this many tokens

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

  // The keys begin..end-1 of one sequence: leaves acc, running_max, total.
  void run(const scalar_t* query, const scalar_t* k_cache, const scalar_t* v_cache,
           const int32_t* blocks, int64_t begin, int64_t end, float scale) {
    const int64_t H = shape.num_heads, D = shape.head_dim, bs = shape.block_size;
    for (int64_t i = 0; i < H * D; ++i) q[i] = f32(query[i]);
    std::fill(acc.begin(), acc.end(), 0.f);
    std::fill(running_max.begin(), running_max.end(), -std::numeric_limits<float>::infinity());
    std::fill(total.begin(), total.end(), 0.f);
    for (int64_t start = begin; start < end;) {
      const int64_t offset = start % bs;
      const int64_t n = std::min({kTile, bs - offset, end - start});
      const int64_t slot = int64_t(blocks[start / bs]) * bs + offset;  // the tile's first
      if (start + n < end) {  // the next tile's rows, on their way during this one
        const int64_t next = start + n;
        const int64_t next_slot = int64_t(blocks[next / bs]) * bs + next % bs;
        const int64_t next_n = std::min({kTile, bs - next % bs, end - next});
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
  }

  // A whole context: the output, normalized; and, when asked (`lse` not
  // null), each head's log-sum-exp of its scores, for cascade attention.
  void finish(scalar_t* out, float* lse) const {
    const int64_t H = shape.num_heads, D = shape.head_dim;
    for (int64_t h = 0; h < H; ++h) {
      const float inv = 1.f / total[h];
      for (int64_t d = 0; d < D; ++d)
        out[h * D + d] = static_cast<scalar_t>(acc[h * D + d] * inv);
      if (lse) lse[h] = running_max[h] + std::log(total[h]);
    }
  }

  // A piece of a context: its unnormalized sums and its maxima, merged later.
  void save_piece(float* piece_acc, float* piece_max, float* piece_total) const {
    std::copy(acc.begin(), acc.end(), piece_acc);
    std::copy(running_max.begin(), running_max.end(), piece_max);
    std::copy(total.begin(), total.end(), piece_total);
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

// A part of one sequence's context: keys begin..end-1. `index`: its row in
// the pieces' buffers (-1: the whole context, written straight to the output).
struct Piece {
  int64_t seq, begin, end, index;
};

// Every sequence's context, the longest first; cut into pieces of kPiece
// tokens where one context alone is more than a thread's share of the
// batch's keys (a few long contexts on more threads than sequences).
// Otherwise whole contexts balance the threads well enough, and pieces
// would only add their merge.
std::vector<Piece> plan_pieces(const int32_t* context_lens, int64_t num_seqs,
                               int64_t num_threads, std::vector<int64_t>& first_piece) {
  int64_t longest = 0, keys = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    longest = std::max<int64_t>(longest, context_lens[s]);
    keys += context_lens[s];
  }
  const bool cut = longest * num_threads > keys;
  std::vector<Piece> pieces;
  int64_t saved = 0;  // pieces that are parts of a longer context
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = context_lens[s];
    first_piece[s] = cut && len > kPiece ? saved : -1;
    if (first_piece[s] < 0) {
      pieces.push_back({s, 0, len, -1});
      continue;
    }
    for (int64_t begin = 0; begin < len; begin += kPiece)
      pieces.push_back({s, begin, std::min(len, begin + kPiece), saved++});
  }
  std::stable_sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) {
    return a.end - a.begin > b.end - b.begin;
  });
  return pieces;
}

// One sequence's pieces -> its output: every piece's sums rescaled to the
// largest maximum among them, added, divided by the added totals (and the
// log-sum-exp of each head's scores where `lse` is not null).
template <typename scalar_t>
void merge_pieces(const float* acc, const float* maxima, const float* totals,
                  int64_t num_pieces, int64_t H, int64_t D, scalar_t* out, float* lse) {
  std::vector<float> sum(D);
  for (int64_t h = 0; h < H; ++h) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < num_pieces; ++p) m = std::max(m, maxima[p * H + h]);
    float total = 0.f;
    std::fill(sum.begin(), sum.end(), 0.f);
    for (int64_t p = 0; p < num_pieces; ++p) {
      const float w = std::exp(maxima[p * H + h] - m);
      total += totals[p * H + h] * w;
      for (int64_t d = 0; d < D; ++d) sum[d] += acc[(p * H + h) * D + d] * w;
    }
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = static_cast<scalar_t>(sum[d] / total);
    if (lse) lse[h] = m + std::log(total);
  }
}

}  // namespace

// The output (S, H, D); and where `lse` is defined, (S, H) float32, each
// head's log-sum-exp of its scaled scores.
torch::Tensor decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                     torch::Tensor lse) {
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
  const int64_t H = shape.num_heads, D = shape.head_dim, per_seq = H * D;
  const int64_t num_seqs = query.size(0);
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  std::vector<int64_t> first_piece(num_seqs);
  const std::vector<Piece> pieces = plan_pieces(lens, num_seqs, at::get_num_threads(),
                                                first_piece);
  int64_t num_saved = 0;
  for (const Piece& p : pieces) num_saved += p.index >= 0;
  std::vector<float> piece_acc(num_saved * per_seq), piece_max(num_saved * H),
      piece_total(num_saved * H);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "decode", [&] {
    const scalar_t* q = query.data_ptr<scalar_t>();
    const scalar_t* k = k_cache.data_ptr<scalar_t>();
    const scalar_t* v = v_cache.data_ptr<scalar_t>();
    const int32_t* tables = block_tables.data_ptr<int32_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    float* l = lse.defined() ? lse.data_ptr<float>() : nullptr;
    auto launch = [&](auto head_dim) {
      using Worker = DecodeOne<scalar_t, decltype(head_dim)::value>;
      run_tasks(pieces.size(), [&] { return Worker(shape); }, [&](Worker& one, int64_t i) {
        const Piece& p = pieces[i];
        one.run(q + p.seq * per_seq, k, v, tables + p.seq * shape.max_blocks, p.begin, p.end,
                static_cast<float>(scale));
        if (p.index < 0) one.finish(o + p.seq * per_seq, l ? l + p.seq * H : nullptr);
        else one.save_piece(&piece_acc[p.index * per_seq], &piece_max[p.index * H],
                            &piece_total[p.index * H]);
      });
    };
    if (shape.head_dim == 64) launch(std::integral_constant<int64_t, 64>());
    else if (shape.head_dim == 128) launch(std::integral_constant<int64_t, 128>());
    else launch(std::integral_constant<int64_t, 0>());
    at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {  // the cut contexts
      for (int64_t s = begin; s < end; ++s) {
        const int64_t first = first_piece[s];
        if (first < 0) continue;
        merge_pieces(&piece_acc[first * per_seq], &piece_max[first * H], &piece_total[first * H],
                     (lens[s] + kPiece - 1) / kPiece, H, D, o + s * per_seq,
                     l ? l + s * H : nullptr);
      }
    });
  });
  return out;
}

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale) {
  return decode(query, k_cache, v_cache, block_tables, context_lens, scale, torch::Tensor());
}

// Cascade attention's suffix part (ch05): the output and its log-sum-exp.
std::tuple<torch::Tensor, torch::Tensor> paged_decode_attention_lse(
    torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
    torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  auto lse = torch::empty({query.size(0), query.size(1)}, query.options().dtype(torch::kFloat));
  return {decode(query, k_cache, v_cache, block_tables, context_lens, scale, lse), lse};
}

// Cascade attention's last step (ch05): two parts of one softmax attention,
// each normalized over its own keys, -> the whole, weighted by their
// log-sum-exps. out_*: (S, H, D); lse_*: (S, H) float32.
torch::Tensor merge_attn_states(torch::Tensor prefix_out, torch::Tensor prefix_lse,
                                torch::Tensor suffix_out, torch::Tensor suffix_lse) {
  TORCH_CHECK(prefix_out.sizes() == suffix_out.sizes() && prefix_out.dim() == 3,
              "both parts (S, H, D)");
  TORCH_CHECK(prefix_lse.scalar_type() == torch::kFloat && suffix_lse.scalar_type() == torch::kFloat,
              "log-sum-exps: float32");
  prefix_out = prefix_out.contiguous();
  suffix_out = suffix_out.contiguous();
  prefix_lse = prefix_lse.contiguous();
  suffix_lse = suffix_lse.contiguous();
  auto out = torch::empty_like(prefix_out);
  const int64_t rows = prefix_out.size(0) * prefix_out.size(1), D = prefix_out.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "merge", [&] {
    const scalar_t* a = prefix_out.data_ptr<scalar_t>();
    const scalar_t* b = suffix_out.data_ptr<scalar_t>();
    const float* la = prefix_lse.data_ptr<float>();
    const float* lb = suffix_lse.data_ptr<float>();
    scalar_t* o = out.data_ptr<scalar_t>();
    for (int64_t r = 0; r < rows; ++r) {  // r: one (sequence, head)
      const float m = std::max(la[r], lb[r]);
      const float wa = std::exp(la[r] - m), wb = std::exp(lb[r] - m);
      const float inv = 1.f / (wa + wb);
      for (int64_t d = 0; d < D; ++d)
        o[r * D + d] = static_cast<scalar_t>((f32(a[r * D + d]) * wa + f32(b[r * D + d]) * wb) * inv);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("merge_attn_states", &merge_attn_states,
        "Two parts of one attention, merged by their log-sum-exps (cascade attention)");
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention reading the paged KV cache in place (CPU)");
  m.def("paged_decode_attention_lse", &paged_decode_attention_lse,
        "The same, with each head's log-sum-exp (cascade attention's suffix)");
}
