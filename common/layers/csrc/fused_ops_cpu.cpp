// The elementwise work around a Llama layer's products, one pass each, on
// the CPU (ch05). Python side and the PyTorch reference:
// common/layers/cpu_fused.py.
//
// In PyTorch each of these is several ops, each a pass over the whole
// batch with its own temporary: RMSNorm is seven (to float32, square, mean,
// add eps, rsqrt, multiply, back, times the weight), the rotary embedding
// five, and the residual add one more. Here each is one loop over the rows,
// in parallel over the intra-op threads, with a row in cache from first
// touch to last.
//
// The values are rounded to the model's dtype exactly where PyTorch's ops
// round them (HF's RMSNorm normalizes in float32, rounds, then multiplies by
// the weight in the model's dtype), so bfloat16 gives PyTorch's numbers; and
// -ffp-contract=off keeps the compiler from fusing a multiply and an add
// into one rounding. Only the sum of squares is added in another order.
//
// Left out: SiLU x up (measured no faster than PyTorch's two ops, whose exp
// is vectorized), the rotary cos/sin table (computed once per step in Python).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace {

constexpr int64_t kRowsPerTask = 16;  // below this, a batch runs on one thread

template <typename T>
inline float f32(T x) { return static_cast<float>(x); }

// v rounded to the dtype, as a float (exact), and stored in the dtype.
template <typename scalar_t>
inline float rounded(float v) { return f32(static_cast<scalar_t>(v)); }
template <typename scalar_t>
inline void store(scalar_t* p, float v) { *p = static_cast<scalar_t>(v); }

// bfloat16: round to nearest even on the bits (c10's rule for finite values),
// written so that the compiler can vectorize the loops that call it.
template <>
inline float rounded<c10::BFloat16>(float v) {
  uint32_t bits = __builtin_bit_cast(uint32_t, v);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return __builtin_bit_cast(float, bits & 0xffff0000u);
}
template <>
inline void store<c10::BFloat16>(c10::BFloat16* p, float v) {  // v: already rounded
  *reinterpret_cast<uint16_t*>(p) = uint16_t(__builtin_bit_cast(uint32_t, v) >> 16);
}

// One row: out = weight * dtype(x * rsqrt(mean(x^2) + eps)).
template <typename scalar_t>
void rms_norm_row(const scalar_t* x, const scalar_t* weight, scalar_t* out, int64_t n,
                  float eps) {
  float sum_squares = 0.f;
#pragma omp simd reduction(+ : sum_squares)
  for (int64_t i = 0; i < n; ++i) sum_squares += f32(x[i]) * f32(x[i]);
  const float inv_rms = 1.f / std::sqrt(sum_squares / n + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i)
    store(&out[i], rounded<scalar_t>(f32(weight[i]) * rounded<scalar_t>(f32(x[i]) * inv_rms)));
}

// residual += x, rounded as PyTorch's add.
template <typename scalar_t>
void add_row(scalar_t* __restrict__ residual, const scalar_t* __restrict__ x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i)
    store(&residual[i], rounded<scalar_t>(f32(residual[i]) + f32(x[i])));
}

// One head of one token: (x1, x2) -> (x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2),
// each product and the sum rounded as PyTorch's x * cos + rotate_half(x) * sin.
template <typename scalar_t>
void rotate_row(scalar_t* __restrict__ row, const scalar_t* __restrict__ c,
                const scalar_t* __restrict__ s, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = f32(row[i]), x2 = f32(row[i + half]);
    store(&row[i], rounded<scalar_t>(rounded<scalar_t>(x1 * f32(c[i])) +
                                     rounded<scalar_t>(-x2 * f32(s[i]))));
    store(&row[i + half], rounded<scalar_t>(rounded<scalar_t>(x2 * f32(c[i + half])) +
                                            rounded<scalar_t>(x1 * f32(s[i + half]))));
  }
}

}  // namespace

// x (T, hidden) -> a new (T, hidden).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous(), "x (T, hidden)");
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const int64_t n = x.size(1);
    const scalar_t* src = x.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        rms_norm_row(src + r * n, weight.data_ptr<scalar_t>(), dst + r * n, n, float(eps));
    });
  });
  return out;
}

// In place: residual = residual + x, then x = rms_norm(residual). The
// residual stream's add and the next norm in one pass (vLLM's
// fused_add_rms_norm).
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                        double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.is_contiguous() &&
              x.sizes() == residual.sizes(), "x, residual: (T, hidden), contiguous");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_norm", [&] {
    const int64_t n = x.size(1);
    scalar_t* xs = x.data_ptr<scalar_t>();
    scalar_t* res = residual.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        add_row(res + r * n, xs + r * n, n);
        rms_norm_row(res + r * n, weight.data_ptr<scalar_t>(), xs + r * n, n, float(eps));
      }
    });
  });
}

// In place on x (T, heads, head_dim), which may be a view of the fused
// q/k/v output (rows strided): x = x * cos + rotate_half(x) * sin, where
// rotate_half(x) = (-x2, x1) for the halves x1, x2. cos, sin: (T, head_dim).
void rotary_embedding(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x (T, heads, head_dim), last dim contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == x.size(2),
              "cos, sin: (T, head_dim), contiguous");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    const int64_t heads = x.size(1), dim = x.size(2), half = dim / 2;
    const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
    scalar_t* base = x.data_ptr<scalar_t>();
    const scalar_t* cos_t = cos.data_ptr<scalar_t>();
    const scalar_t* sin_t = sin.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* c = cos_t + t * dim;
        const scalar_t* s = sin_t + t * dim;
        for (int64_t h = 0; h < heads; ++h) {
          rotate_row(base + t * token_stride + h * head_stride, c, s, half);
        }
      }
    });
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, as HF computes it (CPU)");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; x = rms_norm(residual)");
  m.def("rotary_embedding", &rotary_embedding, "x = x * cos + rotate_half(x) * sin, in place");
}
