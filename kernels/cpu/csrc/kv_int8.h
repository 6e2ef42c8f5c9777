// The int8 KV cache of the paged-attention kernel (paged_attention.cpp): its tile layout, the
// widening loads and the quantizing write. Private to the attention kernel (namespace sf_attn).
//
// A (block, kv head) tile of an int8 cache is block_size * D int8 codes in the fp32/bf16 tiles'
// layout (K transposed [D][block_size], V row-major [block_size][D]) followed by block_size
// float32 scales, one per token: value = code * scale, scale = max |x| / 127 over the token's
// head_dim values, code = round-to-nearest-even(x / scale) (0 for an all-zero row). A scale per
// token (and head), not per block, because a block fills over several steps: a scale fixed by
// its first token would clip later, larger ones, and widening it later would mean requantizing
// codes already written. The kernel applies it where it costs least: K's scales multiply the
// 16 scores of a tile once (S = (Q . codes) * scale), V's fold into P's columns before P.V.
// The scales live inside the tile, so they travel with their block (prefix caching, block
// tables) and the pool is one tensor per K and V as for the other dtypes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "attention_simd.h"
#include "bf16.h"

// In the kernel's unnamed namespace: its load_kv overloads there would hide these otherwise.
namespace sf_attn {
namespace {

constexpr int I8_SCALE_BYTES = 4;  // a float32 scale per token and head, K and V each

// Bytes of one (block, head) tile of an int8 cache: codes, then the block's scales.
static inline int64_t i8_tile_bytes(int bs, int D) { return int64_t(bs) * (D + I8_SCALE_BYTES); }

static inline float load_scale(const int8_t* p) {
    float s;
    std::memcpy(&s, p, sizeof(s));
    return s;
}

// VL int8 codes widened to floats: one vpmovsxbd and one vcvtdq2ps. Intrinsics, because GCC 12
// compiles the generic __builtin_convertvector from int8 lanes one byte at a time; other widths
// (SF_ATTN_VL test builds, no AVX2) take the scalar loop.
static inline vf load_kv(const int8_t* p) {
#if SF_ATTN_WIDTH == 16 && defined(__AVX512F__)
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif SF_ATTN_WIDTH == 8 && defined(__AVX2__)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
    vf r;
    for (int i = 0; i < VL; ++i) r[i] = float(p[i]);
    return r;
#endif
}
static inline v8 load_kv8(const int8_t* p) {
#if defined(__AVX2__)
    return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
    v8 r;
    for (int i = 0; i < 8; ++i) r[i] = float(p[i]);
    return r;
#endif
}
static inline float kv_to_f32(int8_t x) { return float(x); }

static inline float in_f32(float x) { return x; }
static inline float in_f32(uint16_t h) { return sf_bf16::to_f32(h); }

// One token's head_dim values x (float or bf16) as codes at q[d * stride] and its scale at *s.
template <typename Tin>
static inline void quantize_token(const Tin* x, int D, int8_t* q, int64_t stride, int8_t* s) {
    float amax = 0.0f;
    for (int d = 0; d < D; ++d) amax = std::max(amax, std::fabs(in_f32(x[d])));
    const float scale = amax / 127.0f;
    std::memcpy(s, &scale, sizeof(scale));
    for (int d = 0; d < D; ++d) {
        // x / scale as torch divides (not times a reciprocal): the reference rounds the same.
        const float r = scale > 0.0f ? std::nearbyint(in_f32(x[d]) / scale) : 0.0f;
        q[d * stride] = int8_t(std::min(127.0f, std::max(-127.0f, r)));
    }
}

// Scatter k/v [T][Hkv][D] (float or bf16) into int8 caches (K transposed) at slot_mapping
// (< 0 skips the token), quantizing each token's row per head. Returns 0 or an error code.
template <typename Tin>
static int write_kv_i8(const Tin* k, int64_t k_st, int64_t k_sh, const Tin* v, int64_t v_st, int64_t v_sh,
                       int8_t* k_cache, int8_t* v_cache, const int64_t* slot_mapping, int num_tokens, int Hkv, int D,
                       int bs, int64_t num_blocks, int num_threads, int bad_shape, int bad_block) {
    if (num_tokens < 0 || Hkv <= 0 || D <= 0 || bs <= 0) return bad_shape;
    const int64_t nslots = num_blocks * bs;
    for (int t = 0; t < num_tokens; ++t)
        if (slot_mapping[t] >= nslots) return bad_block;
    const int64_t tile = i8_tile_bytes(bs, D);
    const bool par = num_threads > 1 && int64_t(num_tokens) * Hkv * D >= (1 << 15);
#pragma omp parallel for num_threads(num_threads) if (par) schedule(static)
    for (int t = 0; t < num_tokens; ++t) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        const int64_t blk = slot / bs;
        const int off = int(slot % bs);
        for (int h = 0; h < Hkv; ++h) {
            const int64_t base = (blk * Hkv + h) * tile;
            const int64_t scale_at = base + int64_t(bs) * D + int64_t(off) * I8_SCALE_BYTES;
            quantize_token(k + t * k_st + h * k_sh, D, k_cache + base + off, bs, k_cache + scale_at);
            quantize_token(v + t * v_st + h * v_sh, D, v_cache + base + int64_t(off) * D, 1, v_cache + scale_at);
        }
    }
    return 0;
}

}  // namespace
}  // namespace sf_attn
