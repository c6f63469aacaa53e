// What the CPU attention kernels share (ch04): a value to float32, and a
// vector of 16 floats.
//
// `Vec16` is a GCC/Clang vector extension, not an intrinsic: the compiler
// lowers `a + b * c` on it to one AVX-512 FMA, or two AVX2 ones, whatever
// -march=native offers. Loads and stores go through memcpy, which compiles
// to one unaligned vector move.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>

namespace cpu_attention {

// One value to float32. bfloat16 is float32's upper 16 bits: a shift,
// written on the bits so that the compiler vectorizes the loops around it.
template <typename scalar_t>
inline float f32(scalar_t x) { return static_cast<float>(x); }
inline float f32(c10::BFloat16 x) { return __builtin_bit_cast(float, uint32_t(x.x) << 16); }

typedef float Vec16 __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

inline Vec16 load(const float* p) { Vec16 v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, Vec16 v) { std::memcpy(p, &v, sizeof v); }
inline Vec16 broadcast(float x) { return Vec16{} + x; }

}  // namespace cpu_attention
