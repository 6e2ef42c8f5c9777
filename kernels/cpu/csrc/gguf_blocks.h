// GGUF's block formats as quant4.cpp packs them, and their widening to float32 (the float form).
// One column block (NB columns) of a weight is a run of records, each covering RK k of the NB
// columns (RK = 32, or 256 for the K-quants' super-blocks):
//   header, field by field, each [NB] (or [sub-blocks][NB]) per column:
//     Q4_0, Q5_0, Q8_0: d fp16            Q4_1, Q5_1: d, m fp16
//     Q4_K, Q5_K: d, dmin fp16, sc[8], m[8] uint8 (the 6-bit sub-block scales and minimums)
//     Q6_K: d fp16, sc[16] int8
//   then RK / 32 groups of 32 k, each: per k, NB / 2 bytes of the low 4 bits (NV / 2 chunks of
//   VW bytes: column 2c*VW + i in the low nibble of byte i of chunk c, (2c+1)*VW + i in its
//   high nibble), then per k NB * HB bits of the high bits (Q5: HB = 1, Q6_K: 2), column j at
//   bits [j HB, j HB + HB) read little-endian; Q8_0 has NB int8 per k instead.
// The header keeps the file's values (fp16 and 6-bit integers, one byte each); products of scales
// are formed per call. Widened weights equal the `gguf` package's dequantization bit for bit:
//   Q4_0 d (q - 8)   Q5_0 d (q - 16)   Q4_1, Q5_1 fl(d q) + m   Q8_0 d q
//   Q4_K, Q5_K fl(fl(d sc) q) - fl(dmin m)   Q6_K fl(d sc) (q - 32), sc per 16 k
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "elementwise_simd.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace sf_gguf {

using namespace sf_ew;

constexpr int NV = 4;        // vectors per column block (linear.cpp's)
constexpr int NB = NV * VW;  // columns per block
constexpr int QK = 32;       // k per group

enum Kind { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, Q5_0 = 3, Q5_1 = 4, Q4_K = 5, Q5_K = 6, Q6_K = 7 };
constexpr int NKINDS = 8;

constexpr bool k_quant(int kind) { return kind == Q4_K || kind == Q5_K || kind == Q6_K; }
constexpr int record_k(int kind) { return k_quant(kind) ? 256 : QK; }
constexpr int groups_per_record(int kind) { return record_k(kind) / QK; }
constexpr int head_bytes(int kind) {  // per column
    return kind == Q4_1 || kind == Q5_1 ? 4 : kind == Q4_K || kind == Q5_K ? 20 : kind == Q6_K ? 18 : 2;
}
constexpr int high_bits(int kind) { return kind == Q6_K ? 2 : kind == Q5_0 || kind == Q5_1 || kind == Q5_K ? 1 : 0; }
constexpr int64_t group_bytes(int kind) {
    return kind == Q8_0 ? QK * NB : QK * NB / 2 + QK * NB * high_bits(kind) / 8;
}
constexpr int64_t record_bytes(int kind) { return int64_t(head_bytes(kind)) * NB + groups_per_record(kind) * group_bytes(kind); }

// VW bytes widened to int32 lanes (zero-extended for uint8_t, sign-extended for int8_t): one
// vpmovzxbd / vpmovsxbd on AVX-512 and AVX2 (GCC scalarises the generic conversion), the vector
// extensions elsewhere.
template <typename B>
inline vi widen(const B* p) {
    constexpr bool is_signed = std::is_signed_v<B>;
#if SF_EW_VW == 16 && SF_EW_NATIVE_VW == 16
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return reinterpret_cast<vi>(is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif SF_EW_VW == 8 && defined(__AVX2__)
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return reinterpret_cast<vi>(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#else
    typedef B vb __attribute__((vector_size(VW)));
    vb bytes;
    std::memcpy(&bytes, p, sizeof(bytes));
    return __builtin_convertvector(bytes, vi);
#endif
}

inline float half_to_float(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  // subnormal: normalise
        int e = -1;
        uint32_t m = man;
        do { ++e; m <<= 1; } while (!(m & 0x400u));
        bits = sign | uint32_t(112 - e) << 23 | ((m & 0x3ffu) << 13);
    }
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
}

// NB fp16 scales as NV float vectors (vcvtph2ps with F16C, which every AVX2 CPU has).
inline void load_scales(const uint16_t* h, vf (&out)[NV]) {
    for (int j = 0; j < NV; ++j) {
#if SF_EW_VW == 16 && SF_EW_NATIVE_VW == 16
        out[j] = reinterpret_cast<vf>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + j * VW))));
#elif SF_EW_VW == 8 && defined(__F16C__)
        out[j] = reinterpret_cast<vf>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + j * VW))));
#else
        float f[VW];
        for (int i = 0; i < VW; ++i) f[i] = half_to_float(h[j * VW + i]);
        out[j] = loadu(f);
#endif
    }
}

// Vector j's high bits (HB per column) of one k, as int32 lanes.
template <int HB>
inline vi high_part(const uint8_t* hk, int j) {
    constexpr int bits = VW * HB;
    uint32_t word = 0;
    if constexpr (bits % 8 == 0) {
        std::memcpy(&word, hk + j * (bits / 8), bits / 8);
    } else {  // 4-lane builds with HB = 1: half a byte per vector
        word = hk[j * bits / 8] >> (j * bits % 8);
    }
    vi shift;
    for (int i = 0; i < VW; ++i) shift[i] = i * HB;
    return (vi{} + static_cast<int32_t>(word)) >> shift & ((1 << HB) - 1);
}

// The per-column values a group's weights are formed from: a (d, or d sc), a2 (Q6_K: the
// second 16 k's d sc), b (m, or dmin m). `sub`: the group's index in its record.
template <int KIND>
inline void group_scales(const uint8_t* rec, int sub, vf (&a)[NV], vf (&a2)[NV], vf (&b)[NV]) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(rec);
    load_scales(h, a);
    if constexpr (KIND == Q4_1 || KIND == Q5_1) load_scales(h + NB, b);
    if constexpr (KIND == Q4_K || KIND == Q5_K) {
        vf dmin[NV];
        load_scales(h + NB, dmin);
        const uint8_t* sc = rec + 4 * NB + sub * NB;
        const uint8_t* mn = rec + 12 * NB + sub * NB;
        for (int j = 0; j < NV; ++j) {
            a[j] = a[j] * __builtin_convertvector(widen(sc + j * VW), vf);
            b[j] = dmin[j] * __builtin_convertvector(widen(mn + j * VW), vf);
        }
    }
    if constexpr (KIND == Q6_K) {
        const int8_t* sc = reinterpret_cast<const int8_t*>(rec + 2 * NB) + 2 * sub * NB;
        for (int j = 0; j < NV; ++j) {
            const vf d = a[j];
            a[j] = d * __builtin_convertvector(widen(sc + j * VW), vf);
            a2[j] = d * __builtin_convertvector(widen(sc + NB + j * VW), vf);
        }
    }
}

// One vector of weights from its integers q (low and high bits joined), as gguf computes them.
template <int KIND>
inline vf weights(vi q, vf a, vf b) {
    if constexpr (KIND == Q4_0) return a * __builtin_convertvector(q - 8, vf);
    if constexpr (KIND == Q5_0) return a * __builtin_convertvector(q - 16, vf);
    if constexpr (KIND == Q6_K) return a * __builtin_convertvector(q - 32, vf);
    // numpy rounds the product before the minimum: no fused multiply-add here
    if constexpr (KIND == Q4_1 || KIND == Q5_1) return rounded(a * __builtin_convertvector(q, vf)) + b;
    return rounded(a * __builtin_convertvector(q, vf)) - b;  // Q4_K, Q5_K
}

// Group `sub` of record `rec` widened into buf[0..QK)[NB] (row k of NB floats).
template <int KIND>
inline void widen_group(const uint8_t* rec, int sub, float* buf) {
    constexpr int HB = high_bits(KIND);
    vf a[NV], a2[NV], b[NV];
    group_scales<KIND>(rec, sub, a, a2, b);
    const uint8_t* q = rec + head_bytes(KIND) * NB + sub * group_bytes(KIND);
    for (int k = 0; k < QK; ++k) {
        float* out = buf + k * NB;
        if constexpr (KIND == Q8_0) {
            const int8_t* qk = reinterpret_cast<const int8_t*>(q) + k * NB;
            for (int j = 0; j < NV; ++j)
                storeu(out + j * VW, __builtin_convertvector(widen(qk + j * VW), vf) * a[j]);
        } else {
            const uint8_t* qk = q + k * (NB / 2);
            const uint8_t* hk = q + QK * NB / 2 + k * (NB * HB / 8);
            for (int c = 0; c < NV / 2; ++c) {
                const vi v = widen(qk + c * VW);
                const vi nib[2] = {v & 15, v >> 4};
                for (int h = 0; h < 2; ++h) {
                    const int j = 2 * c + h;
                    vi qj = nib[h];
                    if constexpr (HB > 0) qj |= high_part<HB>(hk, j) << 4;
                    storeu(out + j * VW, weights<KIND>(qj, KIND == Q6_K && k >= 16 ? a2[j] : a[j], b[j]));
                }
            }
        }
    }
}

}  // namespace sf_gguf
