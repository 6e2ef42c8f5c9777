// Vector helpers for elementwise.cpp and the matrix kernels (namespace sf_ew; nothing here is
// exported).
//
// GCC/Clang vector extensions sized for the widest ISA the compiler targets (-march=native):
// 16 floats with AVX-512, 8 with AVX/AVX2, 4 otherwise (SSE / NEON / generic). The operators
// compile to the ISA's vector instructions, so one source serves every machine; the one
// exception is the AVX-512 bf16 load/store below (bf16.h), where GCC's generic lowering is poor.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "bf16.h"

namespace sf_ew {

#if defined(__AVX512F__)
#define SF_EW_NATIVE_VW 16
#elif defined(__AVX__)
#define SF_EW_NATIVE_VW 8
#else
#define SF_EW_NATIVE_VW 4
#endif
#if !defined(SF_EW_VW)  // test override: -DSF_EW_VW=4/8/16 exercises other widths on this machine
#define SF_EW_VW SF_EW_NATIVE_VW
#endif
constexpr int VW = SF_EW_VW;

typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
// Unaligned, aliasing-safe variants for loads/stores through plain float pointers.
typedef float vf_u __attribute__((vector_size(VW * 4), aligned(4), may_alias));

static inline vf loadu(const float* p) { return *reinterpret_cast<const vf_u*>(p); }
static inline void storeu(float* p, vf v) { *reinterpret_cast<vf_u*>(p) = v; }
// a - 0 rather than 0 + a: the compiler may drop the subtraction (exact for every a, -0 too) and
// broadcast straight from memory into the multiply (vfmadd231ps m32{1to16}); 0 + a is not a when
// a is -0, so it kept an add and a register broadcast per row and k in the matrix kernels' inner
// loops, on the same pipes as their multiply-adds.
static inline vf splat(float a) { return a - vf{}; }

static inline float hsum(vf v) {
    // Pairwise halving: a fixed, data-independent order.
    float t[VW];
    std::memcpy(t, &v, sizeof(t));
    for (int w = VW / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; ++i) t[i] += t[i + w];
    return t[0];
}

// Materialise a value so the compiler cannot fuse the multiply that produced it into a following
// add (GCC contracts a*b+c into an FMA in C++ by default). Used where the result must match
// torch's separately rounded products bit for bit.
static inline vf rounded(vf v) {
#if SF_EW_VW > SF_EW_NATIVE_VW  // wider than a register (test builds only): through memory
    asm("" : "+m"(v));
#elif defined(__x86_64__) || defined(__i386__)
    asm("" : "+v"(v));
#else
    asm("" : "+w"(v));
#endif
    return v;
}
static inline float rounded(float v) {
#if defined(__x86_64__) || defined(__i386__)
    asm("" : "+x"(v));
#else
    asm("" : "+w"(v));
#endif
    return v;
}

// exp(x), max error ~1 ulp (Cephes expf: Cody-Waite reduction, degree-6 polynomial), with
// IEEE edge behaviour: x > log(FLT_MAX) -> +inf, gradual underflow to subnormals, 0 below
// about -103.97, NaN -> NaN.
static inline vf exp_v(vf x) {
    vf xc = x > 88.72283935546875f ? splat(88.72283935546875f) : x;
    xc = xc < -103.97f ? splat(-103.97f) : xc;
    // n = round(x / ln2) by the 1.5*2^23 trick (|x/ln2| < 2^22 after clamping).
    const vf magic = splat(12582912.0f);
    vf n = (xc * 1.44269504088896341f + magic) - magic;
    vf r = xc - n * 0.693359375f;  // ln2 split: the high part is exact in float
    r = r - n * -2.12194440e-4f;
    vf z = r * r;
    vf p = splat(1.9875691500E-4f);
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    vf y = p * z + r + 1.0f;
    // y * 2^n with n in [-150, 128], as two in-range powers 2^(n>>1) * 2^(n - (n>>1)).
    vi ni = __builtin_convertvector(n, vi);
    vi n1 = ni >> 1;
    vi b1 = (n1 + 127) << 23, b2 = (ni - n1 + 127) << 23;
    vf s1, s2;
    std::memcpy(&s1, &b1, sizeof(s1));
    std::memcpy(&s2, &b2, sizeof(s2));
    y = (y * s1) * s2;  // above log(FLT_MAX) this overflows to +inf, as it should
    y = x < -103.97f ? vf{} : y;
    return y;
}

static inline float exp_s(float x) { return std::exp(x); }

// bf16 tensors travel as their uint16_t bits (bf16.h); the vector forms below widen exactly and
// narrow to nearest even like the scalar ones.
typedef uint32_t vu __attribute__((vector_size(VW * 4)));
typedef uint16_t vh __attribute__((vector_size(VW * 2)));
typedef uint16_t vh_u __attribute__((vector_size(VW * 2), aligned(2), may_alias));

static inline vf loadu(const uint16_t* p) {
#if SF_EW_VW == 16 && SF_EW_NATIVE_VW == 16
    return reinterpret_cast<vf>(sf_bf16::widen16(p));
#else
    return reinterpret_cast<vf>(__builtin_convertvector(*reinterpret_cast<const vh_u*>(p), vu) << 16);
#endif
}
static inline vu bf16_round_bits(vf v) {
    const vu b = reinterpret_cast<vu>(v);
    return b + (0x7fffu + ((b >> 16) & 1u));
}
static inline void storeu(uint16_t* p, vf v) {
#if SF_EW_VW == 16 && SF_EW_NATIVE_VW == 16
    sf_bf16::store_low16(p, reinterpret_cast<__m512i>(bf16_round_bits(v) >> 16));
#else
    *reinterpret_cast<vh_u*>(p) = __builtin_convertvector(bf16_round_bits(v) >> 16, vh);
#endif
}
static inline float load1(const float* p) { return *p; }
static inline float load1(const uint16_t* p) { return sf_bf16::to_f32(*p); }
static inline void store1(float* p, float v) { *p = v; }
static inline void store1(uint16_t* p, float v) { *p = sf_bf16::from_f32(v); }

// A value as torch holds an intermediate result in the tensor dtype T: fp32 kept apart from a
// following add (no FMA contraction, `rounded`), bf16 rounded to bf16.
template <typename T>
static inline vf round_to(vf v);
template <>
inline vf round_to<float>(vf v) { return rounded(v); }
template <>
inline vf round_to<uint16_t>(vf v) { return reinterpret_cast<vf>(bf16_round_bits(v) & 0xffff0000u); }
template <typename T>
static inline float round_to(float v);
template <>
inline float round_to<float>(float v) { return rounded(v); }
template <>
inline float round_to<uint16_t>(float v) { return sf_bf16::to_f32(sf_bf16::from_f32(v)); }

// SwiGLU's gate on values as torch holds them in T: silu(g) rounded to T, times u (the caller
// stores the product, rounding it to T).
template <typename T>
static inline vf silu_mul(vf g, vf u) {
    return round_to<T>(g / (splat(1.0f) + exp_v(-g))) * u;
}

// Calls fn(std::integral_constant<int, R>{}, m) for the register strips of rows [0..rows): whole
// strips of STRIP rows from m = 0, then one strip of the R < STRIP rows left (the matrix kernels'
// row loop, R a template argument so each strip's accumulators stay in registers).
template <int STRIP, typename Fn>
inline void for_each_strip(int64_t rows, Fn&& fn) {
    static_assert(STRIP >= 1 && STRIP <= 6, "strips of 1 to 6 rows");
    int64_t m = 0;
    for (; m + STRIP <= rows; m += STRIP) fn(std::integral_constant<int, STRIP>{}, m);
    switch (rows - m) {
        case 1: fn(std::integral_constant<int, 1>{}, m); break;
        case 2: if constexpr (STRIP > 2) fn(std::integral_constant<int, 2>{}, m); break;
        case 3: if constexpr (STRIP > 3) fn(std::integral_constant<int, 3>{}, m); break;
        case 4: if constexpr (STRIP > 4) fn(std::integral_constant<int, 4>{}, m); break;
        case 5: if constexpr (STRIP > 5) fn(std::integral_constant<int, 5>{}, m); break;
        default: break;
    }
}

}  // namespace sf_ew
