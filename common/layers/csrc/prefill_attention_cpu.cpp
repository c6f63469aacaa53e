// Prefill attention over a paged KV cache, on the CPU, flash-attention style
// (ch04). Python side and the reference it is tested against:
// common/layers/cpu_attention.py.
//
// A chunk of sequence s is its query_len new tokens, the last of its
// context_len tokens (the earlier ones are in the cache already: a prefix
// hit, an earlier chunk). New token j sits at position
// context_len - query_len + j and sees the keys 0..that position (causal).
//
// The work is cut into tasks of (sequence, query tile of up to kQueryTile
// new tokens, KV head). A task's rows are its tokens x the query heads that
// share that KV head (grouped-query attention: one K/V tile serves them
// all). A task walks the keys its last row sees, kKeyTile at a time:
//   1. stage the key tile: its K rows read in place through the block
//      table, widened to float32 and transposed (head_dim x kKeyTile); its
//      V rows the same, not transposed (kKeyTile x head_dim);
//   2. scores = Q K^T for every row (the queries scaled beforehand);
//   3. online softmax per row: keys past the row's position masked, the
//      running maximum and sum updated, the row's output rescaled when the
//      maximum grows (as flash attention does);
//   4. output += P V.
// Steps 2 and 4 are small matrix products written as register tiles: a few
// rows at a time, every step of the inner loop one vector (16 keys, or 16
// values of head_dim) times a broadcast number, the sums kept in registers.
// Each K/V tile is read from the cache once per task, not once per query
// row as a decode row would (paged_attention_cpu.cpp).
//
// The tasks go to the intra-op threads from one shared counter, the
// costliest first (rows x keys seen): a chunk's last tiles see the most
// keys, and no thread waits long on another's tail.
//
// The same tiles serve cascade attention's shared prefix (ch05,
// common/layers/cascade_attention.py): `shared_prefix_attention` puts every
// decode query of a step against the blocks they all begin with, no mask,
// and also returns each row's log-sum-exp, max + log(sum), for the merge.
//
// Left out: AMX and AVX512-BF16 dot products (bfloat16 is widened to float32
// as it is staged), head_dim other than 64 and 128 (the Python side sends
// those to the reference), ALiBi, sliding windows, soft-capping.
#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using namespace cpu_attention;

constexpr int64_t kQueryTile = 64;  // new tokens per task, at most
constexpr int64_t kKeyTile = 64;    // keys staged at once
constexpr int64_t kKeyVecs = kKeyTile / kLanes;
constexpr int64_t kScoreRows = 4;   // rows per register tile of step 2 (16 vectors)

struct Task {
  int64_t seq, first_token, num_tokens, kv_head, cost;
};

struct Layout {
  int64_t num_heads, num_kv_heads, block_size, max_blocks;
  int64_t group() const { return num_heads / num_kv_heads; }  // query heads per KV head
};

// One thread's buffers, kept from call to call: sized at the first call,
// they are not allocated again (nor their pages faulted in) at every layer.
struct Scratch {
  std::vector<float> q, out, row_max, row_sum, scores, keys_t, values;
};
thread_local Scratch scratch;

constexpr int64_t padded(int64_t rows) {  // whole register tiles of rows
  return (rows + kScoreRows - 1) / kScoreRows * kScoreRows;
}

// The four steps for one task at a time, in this thread's buffers.
// kHeadDim: 64 or 128, known at compile time so that the register tiles unroll.
template <typename scalar_t, int64_t kHeadDim>
struct PrefillTask {
  using Scalar = scalar_t;
  static constexpr int64_t D = kHeadDim;
  static constexpr int64_t kDimVecs = D / kLanes;
  static constexpr int64_t kValueRows = 16 / kDimVecs;  // rows per register tile of step 4
  const Layout& layout;
  float *q, *out, *row_max, *row_sum, *scores, *keys_t, *values;

  explicit PrefillTask(const Layout& l) : layout(l) {
    const int64_t rows = padded(kQueryTile * l.group());
    q = sized(scratch.q, rows * D);
    out = sized(scratch.out, rows * D);
    row_max = sized(scratch.row_max, rows);
    row_sum = sized(scratch.row_sum, rows);
    scores = sized(scratch.scores, rows * kKeyTile);
    keys_t = sized(scratch.keys_t, D * kKeyTile);
    values = sized(scratch.values, kKeyTile * D);
  }

  static float* sized(std::vector<float>& buffer, int64_t size) {
    if (int64_t(buffer.size()) < size) buffer.resize(size);
    return buffer.data();
  }

  // Row r = token t of the tile, query head g * group + k, with r = t * group + k.
  // Token 0 of the tile sits at `first_pos`, token t at first_pos + t, and
  // sees the keys 0..its position; the tile reads the first `keys_seen` keys.
  // `lse` (or null): each row's log-sum-exp of its scores, (tokens, H).
  void run(const Task& task, const scalar_t* query, const scalar_t* k_cache,
           const scalar_t* v_cache, const int32_t* blocks, int64_t first_pos,
           int64_t keys_seen, float scale, scalar_t* output, float* lse) {
    const int64_t rows = task.num_tokens * layout.group();
    load_queries(task, query, scale, rows);
    std::fill(out, out + padded(rows) * D, 0.f);
    std::fill(row_max, row_max + rows, -std::numeric_limits<float>::infinity());
    std::fill(row_sum, row_sum + rows, 0.f);
    for (int64_t first_key = 0; first_key < keys_seen; first_key += kKeyTile) {
      const int64_t n = std::min(kKeyTile, keys_seen - first_key);
      stage_keys(task.kv_head, k_cache, v_cache, blocks, first_key, n);
      score_rows(rows);
      softmax_rows(rows, first_key, n, first_pos);
      add_values(rows, n);
    }
    store_output(task, output, lse, rows);
  }

  void load_queries(const Task& task, const scalar_t* query, float scale, int64_t rows) {
    const int64_t group = layout.group(), H = layout.num_heads;
    for (int64_t r = 0; r < padded(rows); ++r) {
      float* dst = &q[r * D];
      if (r >= rows) { std::fill(dst, dst + D, 0.f); continue; }  // padding rows
      const int64_t t = r / group, head = task.kv_head * group + r % group;
      const scalar_t* src = query + ((task.first_token + t) * H + head) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = f32(src[d]) * scale;
    }
  }

  // Step 1: keys first_key .. first_key + n - 1 of one KV head, from their blocks.
  void stage_keys(int64_t kv_head, const scalar_t* k_cache, const scalar_t* v_cache,
                  const int32_t* blocks, int64_t first_key, int64_t n) {
    const int64_t bs = layout.block_size, row = layout.num_kv_heads * D;
    for (int64_t c = 0; c < kKeyTile; ++c) {
      if (c >= n) {  // past the last key: zero scores, masked in step 3
        for (int64_t d = 0; d < D; ++d) keys_t[d * kKeyTile + c] = 0.f;
        continue;
      }
      const int64_t token = first_key + c;
      const int64_t slot = int64_t(blocks[token / bs]) * bs + token % bs;
      const scalar_t* k = k_cache + slot * row + kv_head * D;
      const scalar_t* v = v_cache + slot * row + kv_head * D;
      for (int64_t d = 0; d < D; ++d) keys_t[d * kKeyTile + c] = f32(k[d]);
      for (int64_t d = 0; d < D; ++d) values[c * D + d] = f32(v[d]);
    }
  }

  // Step 2: scores[r][c] = q_r . k_c, kScoreRows rows x kKeyTile keys in registers.
  void score_rows(int64_t rows) {
    const float* __restrict__ keys = keys_t;
    for (int64_t r0 = 0; r0 < rows; r0 += kScoreRows) {
      const float* __restrict__ qr = &q[r0 * D];
      Vec16 acc[kScoreRows][kKeyVecs] = {};
      for (int64_t d = 0; d < D; ++d) {
        Vec16 k[kKeyVecs];
        for (int64_t j = 0; j < kKeyVecs; ++j) k[j] = load(keys + d * kKeyTile + j * kLanes);
        for (int64_t i = 0; i < kScoreRows; ++i) {
          const Vec16 qv = broadcast(qr[i * D + d]);
          for (int64_t j = 0; j < kKeyVecs; ++j) acc[i][j] += qv * k[j];
        }
      }
      float* __restrict__ sr = &scores[r0 * kKeyTile];
      for (int64_t i = 0; i < kScoreRows; ++i)
        for (int64_t j = 0; j < kKeyVecs; ++j) store(sr + i * kKeyTile + j * kLanes, acc[i][j]);
    }
  }

  // Step 3: the row's scores become exp(score - running max), 0 where masked.
  // The maximum over whole vectors of the tile, the masked scores set to -inf.
  void softmax_rows(int64_t rows, int64_t first_key, int64_t n, int64_t first_pos) {
    const int64_t group = layout.group();
    for (int64_t r = 0; r < rows; ++r) {
      float* __restrict__ s = &scores[r * kKeyTile];
      const int64_t pos = first_pos + r / group;  // the row's token's position
      const int64_t seen = std::clamp<int64_t>(pos - first_key + 1, 0, n);
      if (seen == 0) {  // every key of this tile is in the row's future
        std::fill(s, s + kKeyTile, 0.f);
        continue;
      }
      std::fill(s + seen, s + kKeyTile, -std::numeric_limits<float>::infinity());
      const float tile_max = max_of(s);
      if (tile_max > row_max[r]) {  // rescale what was summed under the old maximum
        const float correction = std::exp(row_max[r] - tile_max);
        row_sum[r] *= correction;
        float* o = &out[r * D];
        for (int64_t d = 0; d < D; ++d) o[d] *= correction;
        row_max[r] = tile_max;
      }
      const float m = row_max[r];
      float tile_sum = 0.f;
#pragma omp simd reduction(+ : tile_sum)
      for (int64_t c = 0; c < seen; ++c) tile_sum += (s[c] = std::exp(s[c] - m));
      std::fill(s + seen, s + kKeyTile, 0.f);  // not exp(-inf): the vector exp's slow path
      row_sum[r] += tile_sum;
    }
  }

  static float max_of(const float* s) {  // the largest of kKeyTile scores
    Vec16 m = load(s);
    for (int64_t j = 1; j < kKeyVecs; ++j) {
      const Vec16 v = load(s + j * kLanes);
      m = v > m ? v : m;
    }
    float result = m[0];
    for (int64_t i = 1; i < kLanes; ++i) result = std::max(result, m[i]);
    return result;
  }

  // Step 4: out[r] += sum_c p[r][c] v_c, kValueRows rows x head_dim in registers.
  // The padding rows (past `rows`) have zero queries, so zero scores: they add nothing.
  void add_values(int64_t rows, int64_t n) {
    const float* __restrict__ vals = values;
    for (int64_t r0 = 0; r0 < rows; r0 += kValueRows) {
      const float* __restrict__ p = &scores[r0 * kKeyTile];
      float* __restrict__ o = &out[r0 * D];
      Vec16 acc[kValueRows][kDimVecs];
      for (int64_t i = 0; i < kValueRows; ++i)
        for (int64_t j = 0; j < kDimVecs; ++j) acc[i][j] = load(o + i * D + j * kLanes);
      for (int64_t c = 0; c < n; ++c) {
        Vec16 v[kDimVecs];
        for (int64_t j = 0; j < kDimVecs; ++j) v[j] = load(vals + c * D + j * kLanes);
        for (int64_t i = 0; i < kValueRows; ++i) {
          const Vec16 pv = broadcast(p[i * kKeyTile + c]);
          for (int64_t j = 0; j < kDimVecs; ++j) acc[i][j] += pv * v[j];
        }
      }
      for (int64_t i = 0; i < kValueRows; ++i)
        for (int64_t j = 0; j < kDimVecs; ++j) store(o + i * D + j * kLanes, acc[i][j]);
    }
  }

  void store_output(const Task& task, scalar_t* output, float* lse, int64_t rows) {
    const int64_t group = layout.group(), H = layout.num_heads;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = r / group, head = task.kv_head * group + r % group;
      scalar_t* dst = output + ((task.first_token + t) * H + head) * D;
      const float inv = 1.f / row_sum[r];
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(out[r * D + d] * inv);
      if (lse) lse[(task.first_token + t) * H + head] = row_max[r] + std::log(row_sum[r]);
    }
  }
};

// Every (sequence, query tile, KV head), the costliest first.
std::vector<Task> plan_tasks(const int32_t* query_start_loc, const int32_t* context_lens,
                             int64_t num_seqs, int64_t num_kv_heads) {
  std::vector<Task> tasks;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t query_len = query_start_loc[s + 1] - query_start_loc[s];
    for (int64_t t0 = 0; t0 < query_len; t0 += kQueryTile) {
      const int64_t n = std::min(kQueryTile, query_len - t0);
      const int64_t keys = context_lens[s] - query_len + t0 + n;
      for (int64_t g = 0; g < num_kv_heads; ++g) tasks.push_back({s, t0, n, g, n * keys});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.cost > b.cost; });
  return tasks;
}

// Cascade attention's shared prefix (ch05): every query against the same
// keys, no mask, so a task's cost is its rows. Query tiles small enough
// that each thread gets at least two tasks (a decode batch is a few dozen
// queries: with tiles of kQueryTile, 3 KV heads would be 3 tasks for 2 threads).
std::vector<Task> plan_prefix_tasks(int64_t num_queries, int64_t num_kv_heads,
                                    int64_t num_threads) {
  const int64_t tiles = std::max<int64_t>(1, (2 * num_threads + num_kv_heads - 1) / num_kv_heads);
  const int64_t tile = std::clamp<int64_t>((num_queries + tiles - 1) / tiles, 1, kQueryTile);
  std::vector<Task> tasks;
  for (int64_t t0 = 0; t0 < num_queries; t0 += tile)
    for (int64_t g = 0; g < num_kv_heads; ++g) {
      const int64_t n = std::min(tile, num_queries - t0);
      tasks.push_back({0, t0, n, g, n});
    }
  return tasks;
}

void check_cache(const torch::Tensor& query, const torch::Tensor& k_cache,
                 const torch::Tensor& v_cache) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4, "query (T, H, D), cache (N, B, H_kv, D)");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the cache must be contiguous");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "query heads: a multiple of KV heads");
  TORCH_CHECK(query.size(2) == 64 || query.size(2) == 128, "head_dim 64 or 128");
}

// `fn(worker)` with a null pointer of the worker type for the query's
// dtype and head_dim (the type is what counts).
template <typename Fn>
void dispatch(const torch::Tensor& query, Fn fn) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "prefill", [&] {
    if (query.size(2) == 64) fn(static_cast<PrefillTask<scalar_t, 64>*>(nullptr));
    else fn(static_cast<PrefillTask<scalar_t, 128>*>(nullptr));
  });
}

}  // namespace

torch::Tensor paged_prefill_attention(torch::Tensor query, torch::Tensor k_cache,
                                      torch::Tensor v_cache, torch::Tensor block_tables,
                                      torch::Tensor query_start_loc, torch::Tensor context_lens,
                                      double scale) {
  check_cache(query, k_cache, v_cache);
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 &&
              query_start_loc.scalar_type() == torch::kInt32 &&
              context_lens.scalar_type() == torch::kInt32,
              "block tables, query starts, lengths: int32");
  query = query.contiguous();
  block_tables = block_tables.contiguous();
  query_start_loc = query_start_loc.contiguous();
  context_lens = context_lens.contiguous();
  auto out = torch::empty_like(query);
  const Layout layout{query.size(1), k_cache.size(2), k_cache.size(1), block_tables.size(1)};
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const std::vector<Task> tasks = plan_tasks(starts, lens, context_lens.size(0),
                                             layout.num_kv_heads);
  const int64_t token_stride = layout.num_heads * query.size(2);
  dispatch(query, [&](auto* type) {
    using Worker = std::remove_pointer_t<decltype(type)>;
    using scalar_t = typename Worker::Scalar;
    const scalar_t* q = query.data_ptr<scalar_t>();
    const scalar_t* k = k_cache.data_ptr<scalar_t>();
    const scalar_t* v = v_cache.data_ptr<scalar_t>();
    const int32_t* tables = block_tables.data_ptr<int32_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    run_tasks(tasks.size(), [&] { return Worker(layout); }, [&](Worker& worker, int64_t i) {
      const Task& t = tasks[i];
      const int64_t start = starts[t.seq], query_len = starts[t.seq + 1] - start;
      const int64_t first_pos = lens[t.seq] - query_len + t.first_token;
      worker.run(t, q + start * token_stride, k, v, tables + t.seq * layout.max_blocks,
                 first_pos, first_pos + t.num_tokens, static_cast<float>(scale),
                 o + start * token_stride, nullptr);
    });
  });
  return out;
}

// Cascade attention's shared prefix (ch05): each of S decode queries
// against the same prefix, `prefix_blocks` (int32) whole blocks, no mask.
// Returns the output (S, H, D) and each head's log-sum-exp (S, H) float32.
std::tuple<torch::Tensor, torch::Tensor> shared_prefix_attention(
    torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
    torch::Tensor prefix_blocks, double scale) {
  check_cache(query, k_cache, v_cache);
  TORCH_CHECK(prefix_blocks.scalar_type() == torch::kInt32, "prefix blocks: int32");
  query = query.contiguous();
  prefix_blocks = prefix_blocks.contiguous();
  auto out = torch::empty_like(query);
  auto lse = torch::empty({query.size(0), query.size(1)}, query.options().dtype(torch::kFloat));
  const Layout layout{query.size(1), k_cache.size(2), k_cache.size(1), prefix_blocks.size(0)};
  const int64_t prefix_len = prefix_blocks.size(0) * layout.block_size;
  const std::vector<Task> tasks = plan_prefix_tasks(query.size(0), layout.num_kv_heads,
                                                    at::get_num_threads());
  dispatch(query, [&](auto* type) {
    using Worker = std::remove_pointer_t<decltype(type)>;
    using scalar_t = typename Worker::Scalar;
    const scalar_t* q = query.data_ptr<scalar_t>();
    const scalar_t* k = k_cache.data_ptr<scalar_t>();
    const scalar_t* v = v_cache.data_ptr<scalar_t>();
    const int32_t* blocks = prefix_blocks.data_ptr<int32_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    float* l = lse.data_ptr<float>();
    run_tasks(tasks.size(), [&] { return Worker(layout); }, [&](Worker& worker, int64_t i) {
      // Every query "after" the prefix: its last key is the prefix's last.
      worker.run(tasks[i], q, k, v, blocks, prefix_len - 1, prefix_len,
                 static_cast<float>(scale), o, l);
    });
  });
  return {out, lse};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "Causal prefill attention reading the paged KV cache in place, in tiles (CPU)");
  m.def("shared_prefix_attention", &shared_prefix_attention,
        "Every query against one shared prefix, with log-sum-exps (cascade attention)");
}
