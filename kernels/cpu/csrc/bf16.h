// bf16 <-> fp32 for the CPU kernels (bf16 tensors travel as their uint16_t bits): scalar forms,
// and the AVX-512 vector load / store both kernels' vector code goes through. Widening is exact:
// bf16 is the high half of a float. Narrowing rounds to nearest even, as torch does (NaN
// payloads are not kept).
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace sf_bf16 {

static inline float to_f32(uint16_t h) {
    const uint32_t w = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &w, sizeof(f));
    return f;
}

static inline uint16_t from_f32(float v) {
    uint32_t b;
    std::memcpy(&b, &v, sizeof(b));
    return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__)
// 16 bf16 (in a register, or at p) as 16 floats: one vpmovzxwd and a shift. GCC compiles the
// generic vector-extension widening to two 8-lane halves and an insert (Zen 4, 2 threads: bf16
// rms_norm of 256 x 512 37 -> 30 us, silu_and_mul of 256 x 2 x 1536 160 -> 146-151 us; attention
// over a bf16 cache, perf/kernels/bench_cpu_attention.py --bf16: decode32 0.78-0.80 -> 0.71-0.73 ms).
static inline __m512 widen16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 widen16(const uint16_t* p) {
    return widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The low 16 bits of each lane of `bits` stored as 16 bf16 at p: one vpmovdw (GCC's generic
// narrowing is a vpermt2w).
static inline void store_low16(uint16_t* p, __m512i bits) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bits));
}
#endif

}  // namespace sf_bf16
