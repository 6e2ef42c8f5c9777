// SIMD helpers of the paged-attention kernel (paged_attention.cpp), on GCC vector extensions.
//
// `vf` is the machine's native float vector: 16 lanes (one zmm) under AVX-512, 8 lanes (one ymm)
// under AVX/AVX2, 4 lanes (xmm) otherwise. The kernel works on tiles of 16 keys, i.e. NV = 16 / VL
// native vectors per tile row. (A 64-byte vector type on an AVX2 machine is legal C++ but GCC 12
// spills it to the stack at every operation; native widths stay in registers.)
// SF_ATTN_VL=4|8|16 overrides the width: the code is the same for every width, so a test build
// with -DSF_ATTN_VL=16 checks the AVX-512 code path's results on an AVX2 machine (slowly).
// Everything here is private to the attention kernel (namespace sf_attn).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

// Without AVX the 8-lane helpers pass vectors by value between (inlined) static functions; GCC
// warns about an ABI that never crosses this translation unit.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace sf_attn {

#if defined(SF_ATTN_VL)
#define SF_ATTN_WIDTH SF_ATTN_VL
#elif defined(__AVX512F__)
#define SF_ATTN_WIDTH 16
#elif defined(__AVX__)
#define SF_ATTN_WIDTH 8
#else
#define SF_ATTN_WIDTH 4
#endif
constexpr int VL = SF_ATTN_WIDTH;
static_assert(VL == 4 || VL == 8 || VL == 16, "vector width");

typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4), may_alias));
// 8-lane vector for a head_dim tail of 8 (one ymm with AVX, two xmm without).
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));

constexpr int TN = 16;        // keys per tile
constexpr int NV = TN / VL;   // native vectors per tile row

static inline vf loadu(const float* p) { return *reinterpret_cast<const vfu*>(p); }
static inline void storeu(float* p, vf v) { *reinterpret_cast<vfu*>(p) = v; }
static inline v8 loadu8(const float* p) { return *reinterpret_cast<const v8u*>(p); }
static inline void storeu8(float* p, const v8& v) { *reinterpret_cast<v8u*>(p) = v; }
static inline vf splat(float x) { return x - vf{}; }  // (x - 0 is x for every x; x + 0 is not for -0, so GCC would emit the add)
static inline vf vmax(vf a, vf b) { return a > b ? a : b; }

static inline vi iota_vi() {
    vi r;
    for (int i = 0; i < VL; ++i) r[i] = i;
    return r;
}

// 2^x for x <= 0 (the softmax only needs that range) as 2^n * 2^f, n = round(x), f in
// [-0.5, 0.5], 2^f by a polynomial in f (Horner; its coefficients `c` from the highest degree
// down). x <= -127 (including -inf) gives exactly 0, so masked scores contribute
// nothing even against garbage. Round-to-nearest by adding 1.5 * 2^23 + 127: the low mantissa
// bits of the sum then hold n + 127, which shifted left by 23 is the float 2^n (0.0 for n = -127).
template <int N>
static inline vf exp2_poly(vf x, const float (&c)[N]) {
    const vf magic = splat(12583039.0f);  // 1.5 * 2^23 + 127
    const vf xc = vmax(x, splat(-127.0f));
    const vf t = xc + magic;
    const vf f = xc - (t - magic);
    vf p = splat(c[0]);
    for (int i = 1; i < N; ++i) p = p * f + c[i];
    return p * (vf)((vu)t << 23);  // vector casts reinterpret the bits
}

// Relative error ~2e-7: the Cephes exp2f polynomial.
constexpr float kExp2Cephes[] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                                 5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f};
static inline vf exp2v(vf x) { return exp2_poly(x, kExp2Cephes); }

// Relative error 7.5e-5 (a degree-3 fit of 2^f on [-0.5, 0.5] to its relative error): for
// probabilities rounded to bf16 next (a relative rounding error up to 2^-9 = 2e-3), three fewer
// multiply-adds than exp2v.
constexpr float kExp2Bf16[] = {5.517164721e-2f, 2.426111205e-1f, 6.932609895e-1f, 9.999280737e-1f};
static inline vf exp2v_bf16(vf x) { return exp2_poly(x, kExp2Bf16); }

static inline float exp2s(float x) { return x <= -127.0f ? 0.0f : std::exp2(x); }

// Row reductions of up to VL vectors at once: lane i of the result = max (or sum) over the lanes
// of a[i]. A transpose-and-reduce butterfly: log2(VL) levels of two shuffles and one op per
// pair, about 3 * VL operations for VL rows instead of ~2 * log2(VL) per row.
struct OpMax {
    static vf f(vf a, vf b) { return vmax(a, b); }
};
struct OpAdd {
    static vf f(vf a, vf b) { return a + b; }
};

template <class Op>
static inline vf reduce_lanes_of_rows(const vf* a /* [VL] */) {
#if SF_ATTN_WIDTH == 16
    // Levels 1-2 within each 128-bit quarter: quarter q of b[m] ends up holding rows 4m..4m+3
    // reduced over quarter q of their vectors.
    vf b[4];
    for (int m = 0; m < 4; ++m) {
        vf x[2];
        for (int k = 0; k < 2; ++k) {
            const vf a0 = a[4 * m + 2 * k], a1 = a[4 * m + 2 * k + 1];
            x[k] = Op::f(__builtin_shuffle(a0, a1, vi{0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29}),
                         __builtin_shuffle(a0, a1, vi{2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31}));
        }
        b[m] = Op::f(__builtin_shuffle(x[0], x[1], vi{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}),
                     __builtin_shuffle(x[0], x[1], vi{2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}));
    }
    // Level 3: quarters (0, 1) and (2, 3) combined; e[k] quarter 0/2 = rows 8k..8k+3, 1/3 = 8k+4..8k+7.
    vf e[2];
    for (int k = 0; k < 2; ++k)
        e[k] = Op::f(__builtin_shuffle(b[2 * k], b[2 * k + 1], vi{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}),
                     __builtin_shuffle(b[2 * k], b[2 * k + 1], vi{4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31}));
    // Level 4: the two halves.
    return Op::f(__builtin_shuffle(e[0], e[1], vi{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}),
                 __builtin_shuffle(e[0], e[1], vi{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}));
#elif SF_ATTN_WIDTH == 8
    vf b[4];
    for (int k = 0; k < 4; ++k)
        b[k] = Op::f(__builtin_shuffle(a[2 * k], a[2 * k + 1], vi{0, 8, 1, 9, 4, 12, 5, 13}),
                     __builtin_shuffle(a[2 * k], a[2 * k + 1], vi{2, 10, 3, 11, 6, 14, 7, 15}));
    vf c[2];
    for (int k = 0; k < 2; ++k)
        c[k] = Op::f(__builtin_shuffle(b[2 * k], b[2 * k + 1], vi{0, 1, 8, 9, 4, 5, 12, 13}),
                     __builtin_shuffle(b[2 * k], b[2 * k + 1], vi{2, 3, 10, 11, 6, 7, 14, 15}));
    return Op::f(__builtin_shuffle(c[0], c[1], vi{0, 1, 2, 3, 8, 9, 10, 11}),
                 __builtin_shuffle(c[0], c[1], vi{4, 5, 6, 7, 12, 13, 14, 15}));
#else
    vf b[2];
    for (int k = 0; k < 2; ++k)
        b[k] = Op::f(__builtin_shuffle(a[2 * k], a[2 * k + 1], vi{0, 4, 1, 5}),
                     __builtin_shuffle(a[2 * k], a[2 * k + 1], vi{2, 6, 3, 7}));
    return Op::f(__builtin_shuffle(b[0], b[1], vi{0, 1, 4, 5}), __builtin_shuffle(b[0], b[1], vi{2, 3, 6, 7}));
#endif
}

// R <= VL rows: rows past R repeat row 0 (their lanes are ignored).
template <class Op, int R>
static inline vf reduce_rows(const vf* rows) {
    static_assert(R >= 1 && R <= VL, "rows per reduction");
    vf a[VL];
    for (int i = 0; i < VL; ++i) a[i] = rows[i < R ? i : 0];
    return reduce_lanes_of_rows<Op>(a);
}

}  // namespace sf_attn
