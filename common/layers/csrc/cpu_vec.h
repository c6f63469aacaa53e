// What the CPU attention kernels share (ch04): a value to float32, a
// vector of 16 floats, and the threads' queue of tasks.
//
// `Vec16` is a GCC/Clang vector extension, not an intrinsic: the compiler
// lowers `a + b * c` on it to one AVX-512 FMA, or two AVX2 ones, whatever
// -march=native offers. Loads and stores go through memcpy, which compiles
// to one unaligned vector move.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <atomic>
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

// Tasks 0..num_tasks-1 on the intra-op threads: each thread takes the next
// one from a shared counter, in that order (the caller sorts them, the
// costliest first), so that no thread waits long on another's tail.
// `make_worker()` gives each thread its own buffers; `run(worker, i)` does task i.
template <typename MakeWorker, typename Run>
void run_tasks(int64_t num_tasks, MakeWorker make_worker, Run run) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    auto worker = make_worker();
    for (int64_t i = next++; i < num_tasks; i = next++) run(worker, i);
  });
}

}  // namespace cpu_attention
