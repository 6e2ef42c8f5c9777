// Linear layers for CPUs: y[M, N] = x[M, K] . W[N, K]^T (+ bias), float32 or bf16 (fp32
// accumulation), or int8 (uint8 activations x int8 weights, int32 sums, then scaled), with the
// weight packed once at load into column blocks (splitfuse/kernels/cpu/linear.py packs it and
// documents the API):
//   float32: [N / NB][K][NB]          one row of NB weights per k
//   bf16:    [N / NB][K / 2][NB][2]   pairs of consecutive k per column (the operand order of
//                                     vdpbf16ps); K is padded to even with zeros
//   int8:    [N / NB][K / 4][NB][4]   quads of consecutive k per column (vpdpbusd's order); K
//                                     padded to a multiple of 4 with zeros
// N is padded to a multiple of NB = 4 vectors with zero columns, which the kernel never stores.
// A gated (SwiGLU gate_up) weight [2I, K] is packed with each block holding NB / 2 gate columns
// followed by the same NB / 2 up columns; the kernel then writes silu(gate) * up [M, I] from its
// registers, and the [M, 2I] projection output is never stored.
//
// Per column block and strip of MR rows, the MR x NB outputs stay in registers for the whole K:
// every k loads the block's 4 weight vectors once and multiplies them into all MR rows against a
// broadcast x[row, k] (bf16: the broadcast pair x[row, 2kp..2kp+1], one vdpbf16ps per vector).
// No horizontal sums, and each weight byte is read once per strip: with few rows (decodes) the
// kernel streams the weight at memory speed, with many it is bound by the multiply units.
// Measured on a 2-core Zen 4 (bench model's 32 projections, 50 MB bf16): 1 row 2.28 -> 1.27 ms
// and 16 rows 3.10 -> 2.33 ms against oneDNN on the same blocked weights; 256 rows within 2%
// of it (both at the bf16 multiply peak).
//
// Work items are (column block, row chunk), split over OpenMP: column blocks first (each thread
// streams its own part of the weight); rows are cut into chunks where the blocks alone do not
// share evenly (work_split.h). Every output is one sequential sum over k, so results do not
// depend on the thread count or on how rows are chunked.
//
// The vector code is GCC vector extensions (elementwise_simd.h); vdpbf16ps is used where the
// compiler targets AVX-512 BF16, elsewhere bf16 pairs are widened and multiplied in fp32 (AVX2:
// intrinsics, the weights kept in bf16 in memory and widened in registers by a shift and a mask).
// The int8 form exists with AVX-512 VNNI and on AVX2 builds (vpmaddubsw + vpmaddwd, or AVX-VNNI's
// 256-bit vpdpbusd where the compiler targets it: sf_lin_int8_products); elsewhere the int8
// layers keep oneDNN (sf_lin_has_int8). Measured with the AVX2 build forced on a 2-core Zen 5
// (SPLITFUSE_CPU_ISA=avx2, a proxy for a Zen 3), the bench model's 32 projections, 1 / 16 / 256
// rows: bf16 1.80 / 17.4 / 285 ms (the generic form) -> 0.83 / 4.3 / 58; int8 with quantize
// 0.56 / 2.8 / 37 against oneDNN's int8 (7-bit activations) 2.4 / 5.4 / 30.
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "elementwise_simd.h"
#include "lora_simd.h"
#include "prefetch_ahead.h"
#include "sf_api.h"
#include "work_split.h"

#if defined(__AVX512BF16__) && SF_EW_VW == 16 && SF_EW_NATIVE_VW == 16
#define SF_LIN_BF16_DOT 1
#else
#define SF_LIN_BF16_DOT 0
#endif
// int8 products (u8 activations x s8 weights, 4 per int32 lane: vpdpbusd) with AVX-512 VNNI.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && SF_EW_VW == 16 && SF_EW_NATIVE_VW == 16
#define SF_LIN_VNNI 1
#else
#define SF_LIN_VNNI 0
#endif
// 8-lane builds (AVX2 + FMA: Zen 2/3, Haswell and later). SF_LIN_AVX2 is the int8 path of these
// CPUs (SF_LIN_AVXVNNI: the 256-bit vpdpbusd of AVX-VNNI, Alder Lake / Zen 5 and later, when the
// compiler targets it; else vpmaddubsw + vpmaddwd, see quad_step) and the bf16 path below.
#if defined(__AVX2__) && defined(__FMA__) && SF_EW_VW == 8 && SF_EW_NATIVE_VW == 8
#define SF_LIN_AVX2 1
#else
#define SF_LIN_AVX2 0
#endif
#if SF_LIN_AVX2 && defined(__AVXVNNI__)
#define SF_LIN_AVXVNNI 1
#else
#define SF_LIN_AVXVNNI 0
#endif
#define SF_LIN_INT8 (SF_LIN_VNNI || SF_LIN_AVX2)
#if SF_LIN_BF16_DOT || SF_LIN_INT8
#include <immintrin.h>
#endif

using namespace sf_ew;

namespace {

constexpr int NV = 4;          // weight vectors per column block
constexpr int NB = NV * VW;    // output columns per block
// Rows per register strip: MR * NV accumulators plus NV weight vectors and a broadcast fit the
// register file (32 vector registers with AVX-512, 16 below).
constexpr int MR = SF_EW_NATIVE_VW == 16 ? 6 : 2;
static_assert(MR == sf_lora::LMR && NV == sf_lora::LNV, "lora_simd.h's strips are this kernel's");
// Multiply-adds below which a call stays on the calling thread (a parallel region costs ~1-2 us).
constexpr int64_t kParallelMacs = 1 << 15;

using sf_ahead::Spread;

// float32 strip: rows x[0..R) (row stride sx) against the block w [K][NB].
template <int R>
inline void strip(const float* x, int64_t sx, const float* w, int64_t K, vf (&acc)[MR][NV], const Spread& ahead) {
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < NV; ++j) acc[r][j] = vf{};
    for (int64_t k = 0; k < K; ++k) {
        ahead.at(k);
        const float* wk = w + k * NB;
        const vf w0 = loadu(wk), w1 = loadu(wk + VW), w2 = loadu(wk + 2 * VW), w3 = loadu(wk + 3 * VW);
        for (int r = 0; r < R; ++r) {
            const vf xb = splat(x[r * sx + k]);
            acc[r][0] += w0 * xb;
            acc[r][1] += w1 * xb;
            acc[r][2] += w2 * xb;
            acc[r][3] += w3 * xb;
        }
    }
}

// Calls step(g, xg) for each group g of 4 bytes of consecutive x elements (bf16 pairs, int8
// quads) of rows [0..R), xg holding each row's group as one 32-bit value; a partial last group
// has its missing elements 0 (their packed weights are 0 too).
template <int R, typename E, typename Step>
inline void for_each_group(const E* x, int64_t sx, int64_t K, Step&& step) {
    constexpr int64_t G = 4 / sizeof(E);
    const int64_t full = K / G;
    uint32_t xg[MR];
    for (int64_t g = 0; g < full; ++g) {
        for (int r = 0; r < R; ++r) std::memcpy(&xg[r], x + r * sx + G * g, sizeof(uint32_t));
        step(g, xg);
    }
    if (K % G) {
        for (int r = 0; r < R; ++r) {
            xg[r] = 0;
            std::memcpy(&xg[r], x + r * sx + G * full, (K % G) * sizeof(E));
        }
        step(full, xg);
    }
}

// One k pair of a bf16 strip: the block's weights for pair kp times the rows' pairs
// (x[2kp], x[2kp + 1]) as 32-bit values (the high half 0 for the last pair of an odd K).
template <int R>
inline void pair_step(const uint16_t* wk, const uint32_t (&xp)[MR], vf (&acc)[MR][NV]) {
#if SF_LIN_BF16_DOT
    vu wv[NV];
    for (int j = 0; j < NV; ++j) std::memcpy(&wv[j], wk + j * 2 * VW, sizeof(vu));
    for (int r = 0; r < R; ++r) {
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[r]));
        for (int j = 0; j < NV; ++j)
            acc[r][j] = reinterpret_cast<vf>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(acc[r][j]), (__m512bh)wv[j], xb));
    }
#else
    vu wv[NV];
    for (int j = 0; j < NV; ++j) std::memcpy(&wv[j], wk + j * 2 * VW, sizeof(vu));
    // Each 32-bit lane holds (k even, k odd) of one column: low half, high half.
    vf w_even[NV], w_odd[NV];
    for (int j = 0; j < NV; ++j) {
        w_even[j] = reinterpret_cast<vf>(wv[j] << 16);
        w_odd[j] = reinterpret_cast<vf>(wv[j] & 0xffff0000u);
    }
    for (int r = 0; r < R; ++r) {
        const vf x_even = splat(sf_bf16::to_f32(static_cast<uint16_t>(xp[r])));
        const vf x_odd = splat(sf_bf16::to_f32(static_cast<uint16_t>(xp[r] >> 16)));
        for (int j = 0; j < NV; ++j) acc[r][j] += w_even[j] * x_even + w_odd[j] * x_odd;
    }
#endif
}

#if SF_LIN_AVX2
// One k pair of an AVX2 bf16 strip: each 32-bit lane of a weight vector holds (k even, k odd) of
// one column; the low half shifted up 16 bits and the high half masked are the two weights as
// floats (exact), and so for the broadcast pair of x. Per (row, vector) the pair's two products
// are summed (a multiply, then an FMA: one rounding, as vdpbf16ps sums a pair) and added to the
// accumulator, so the chain through an accumulator is one add per pair.
template <int R>
inline void pair_step_avx2(const uint16_t* wk, const uint32_t* xp, __m256 (&a)[MR][NV]) {
    const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    __m256 xe[R], xo[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
        const __m256i xb = _mm256_set1_epi32(static_cast<int>(xp[r]));
        xe[r] = _mm256_castsi256_ps(_mm256_slli_epi32(xb, 16));
        xo[r] = _mm256_castsi256_ps(_mm256_and_si256(xb, hi));
    }
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + j * 2 * VW));
        const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
        const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(w, hi));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
            a[r][j] = _mm256_add_ps(a[r][j], _mm256_fmadd_ps(wo, xo[r], _mm256_mul_ps(we, xe[r])));
    }
}
#endif

// bf16 strip: rows x[0..R) against the block w [ceil(K / 2)][NB][2].
template <int R>
inline void strip(const uint16_t* x, int64_t sx, const uint16_t* w, int64_t K, vf (&acc)[MR][NV],
                  const Spread& ahead) {
#if SF_LIN_AVX2
    // Written out (GCC kept the generic form's accumulators on the stack: AVX2 has 16 vector
    // registers for MR = 2 rows x NV = 4 accumulators, the weights and the broadcasts).
    __m256 a[MR][NV];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int j = 0; j < NV; ++j) a[r][j] = _mm256_setzero_ps();
    const int64_t full = K / 2;
    uint32_t xp[MR];
    for (int64_t kp = 0; kp < full; ++kp) {
        ahead.at(kp);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) std::memcpy(&xp[r], x + r * sx + 2 * kp, sizeof(uint32_t));
        pair_step_avx2<R>(w + kp * 2 * NB, xp, a);
    }
    if (K & 1) {  // the last pair's odd half is 0 (its packed weights are 0 too)
        for (int r = 0; r < R; ++r) xp[r] = x[r * sx + K - 1];
        pair_step_avx2<R>(w + full * 2 * NB, xp, a);
    }
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < NV; ++j) acc[r][j] = reinterpret_cast<vf>(a[r][j]);
#else
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < NV; ++j) acc[r][j] = vf{};
    for_each_group<R>(x, sx, K, [&](int64_t kp, const uint32_t (&xp)[MR]) {
        ahead.at(kp);
        pair_step<R>(w + kp * 2 * NB, xp, acc);
    });
#endif
}

// Accumulators (+ bias) to y's rows [0..R), columns [0..cols) of this block (cols below the
// block's width only in the last, padded block). GATED (SwiGLU): the block's first NV / 2
// vectors are gate columns and the rest the matching up columns; y gets silu(gate) * up, each
// sum first rounded to T as the unfused projection would store it (elementwise_simd.h:
// silu_mul), so the result is the same as the projection followed by silu_and_mul.
// lora_d (or null): what the rows add to the block (row stride NB, values of T: block_addend),
// added to the rows whose row_slot is not -1 (all rows where row_slot is null) as the unfused
// projection's output plus the delta as a T tensor (for gate_up: before SwiGLU).
template <typename T, int R, bool GATED>
inline void store(vf (&acc)[MR][NV], const float* bias, T* y, int64_t sy, int64_t cols,
                  const float* lora_d = nullptr, const int64_t* row_slot = nullptr) {
    constexpr int OUT = GATED ? NV / 2 : NV;  // output vectors per row
    for (int r = 0; r < R; ++r) {
        if (bias != nullptr)
            for (int j = 0; j < NV; ++j) acc[r][j] += loadu(bias + j * VW);
        if (lora_d != nullptr && (row_slot == nullptr || row_slot[r] >= 0))
            for (int j = 0; j < NV; ++j)
                acc[r][j] = round_to<T>(round_to<T>(acc[r][j]) + loadu(lora_d + r * NB + j * VW));
        vf o[OUT];
        for (int j = 0; j < OUT; ++j)
            o[j] = GATED ? silu_mul<T>(round_to<T>(acc[r][j]), round_to<T>(acc[r][j + OUT])) : acc[r][j];
        if (cols == OUT * VW) {
            for (int j = 0; j < OUT; ++j) storeu(y + r * sy + j * VW, o[j]);
        } else {
            float tmp[OUT * VW];
            for (int j = 0; j < OUT; ++j) storeu(tmp + j * VW, o[j]);
            for (int64_t c = 0; c < cols; ++c) store1(y + r * sy + c, tmp[c]);
        }
    }
}

#if SF_LIN_VNNI
// One quad of k: the block's int8 weights for quad kq times the rows' quads (as 32-bit values).
template <int R>
inline void quad_step(const int8_t* wk, const uint32_t (&xq)[MR], vi (&s)[MR][NV]) {
    vi wv[NV];
    for (int j = 0; j < NV; ++j) std::memcpy(&wv[j], wk + j * 4 * VW, sizeof(vi));
    for (int r = 0; r < R; ++r) {
        const __m512i xb = _mm512_set1_epi32(static_cast<int>(xq[r]));
        for (int j = 0; j < NV; ++j)
            s[r][j] = reinterpret_cast<vi>(_mm512_dpbusd_epi32(reinterpret_cast<__m512i>(s[r][j]), xb,
                                                               reinterpret_cast<__m512i>(wv[j])));
    }
}

// int8 strip: u8 rows x[0..R) (zero point zp) against the s8 block w [ceil(K / 4)][NB][4], into
// exact int32 sums; then each sum less zp * (the column's weight sum) is the product of the
// signed values, scaled by the column's weight scale and the row's activation scale:
// acc = float(sum) * wscale, then rounded(acc * xscale) (+ bias in store), as oneDNN's int8 GEMM
// followed by the dequantize pass computes it.
template <int R>
inline void strip_i8(const uint8_t* x, int64_t sx, const int8_t* w, int64_t K, const int32_t* colsum, int32_t zp,
                     const float* wscale, const float* xscale, vf (&acc)[MR][NV], const Spread& ahead) {
    vi s[MR][NV];
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < NV; ++j) s[r][j] = vi{};
    for_each_group<R>(x, sx, K, [&](int64_t kq, const uint32_t (&xq)[MR]) {
        ahead.at(kq);
        quad_step<R>(w + kq * 4 * NB, xq, s);
    });
    for (int r = 0; r < R; ++r) {
        const vf xs = splat(xscale[r]);
        for (int j = 0; j < NV; ++j) {
            vi cs;
            std::memcpy(&cs, colsum + j * VW, sizeof(cs));
            const vf sum = __builtin_convertvector(s[r][j] - zp * cs, vf) * loadu(wscale + j * VW);
            acc[r][j] = rounded(rounded(sum) * xs);
        }
    }
}

#elif SF_LIN_AVX2
// int8 on 8-lane (AVX2) builds: the same exact int32 sums as the VNNI form, from 256-bit vectors.
// With AVX-VNNI, one vpdpbusd per (row, vector) as there. Without it, vpmaddubsw multiplies u8 x
// s8 bytes and sums adjacent pairs into int16 with saturation: u8 activations up to 255 against
// weights of -127..127 could reach 2 x 255 x 127 > 32767. So the bytes go in as |x - 128| (the
// unsigned operand, 0..128) and w * sign(x - 128) (the signed one, vpsignb; |w| <= 127, so the
// negation cannot wrap): each product is w * (x - 128), a pair at most 2 x 128 x 127 = 32512 in
// magnitude, exact in int16; vpmaddwd against ones sums the pairs of pairs into int32 lanes
// (the quad, as vpdpbusd). The sums are then over x - 128, and (128 - zp) * colsum restores the
// zero point. Weights of -128 are refused when packing for this path (linear.py).
#if SF_LIN_AVXVNNI
constexpr int32_t kI8Bias = 0;  // the sums are over x itself
#else
constexpr int32_t kI8Bias = 128;  // the sums are over x - 128
#endif

template <int R>
inline void quad_step_avx2(const int8_t* wk, const uint32_t* xq, __m256i (&s)[MR][NV]) {
#if SF_LIN_AVXVNNI
    __m256i xb[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) xb[r] = _mm256_set1_epi32(static_cast<int>(xq[r]));
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + j * 4 * VW));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) s[r][j] = _mm256_dpbusd_avx_epi32(s[r][j], xb[r], w);
    }
#else
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i xa[R], xs[R];  // |x - 128| and x - 128, as bytes
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
        xs[r] = _mm256_set1_epi32(static_cast<int>(xq[r] ^ 0x80808080u));
        xa[r] = _mm256_abs_epi8(xs[r]);  // |-128| = 0x80: 128 read as unsigned
    }
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + j * 4 * VW));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const __m256i p16 = _mm256_maddubs_epi16(xa[r], _mm256_sign_epi8(w, xs[r]));
            s[r][j] = _mm256_add_epi32(s[r][j], _mm256_madd_epi16(p16, ones));
        }
    }
#endif
}

template <int R>
inline void strip_i8(const uint8_t* x, int64_t sx, const int8_t* w, int64_t K, const int32_t* colsum, int32_t zp,
                     const float* wscale, const float* xscale, vf (&acc)[MR][NV], const Spread& ahead) {
    __m256i s[MR][NV];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int j = 0; j < NV; ++j) s[r][j] = _mm256_setzero_si256();
    const int64_t full = K / 4;
    uint32_t xq[MR];
    for (int64_t kq = 0; kq < full; ++kq) {
        ahead.at(kq);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) std::memcpy(&xq[r], x + r * sx + 4 * kq, sizeof(uint32_t));
        quad_step_avx2<R>(w + kq * 4 * NB, xq, s);
    }
    if (K % 4) {  // missing elements of the last quad: their packed weights are 0
        for (int r = 0; r < R; ++r) {
            xq[r] = 0;
            std::memcpy(&xq[r], x + r * sx + 4 * full, K % 4);
        }
        quad_step_avx2<R>(w + full * 4 * NB, xq, s);
    }
    for (int r = 0; r < R; ++r) {
        const vf xsc = splat(xscale[r]);
        for (int j = 0; j < NV; ++j) {
            vi cs, sum_i;
            std::memcpy(&cs, colsum + j * VW, sizeof(cs));
            std::memcpy(&sum_i, &s[r][j], sizeof(sum_i));
            const vf sum = __builtin_convertvector(sum_i + (kI8Bias - zp) * cs, vf) * loadu(wscale + j * VW);
            acc[r][j] = rounded(rounded(sum) * xsc);
        }
    }
}
#endif

using sf_lora::Addend;
using sf_lora::block_addend;

// How a call's work splits over the threads (work_split.h). K: the cost per row and column.
inline sf_split::Split split_work(int64_t M, int64_t N, int64_t K, int64_t out_cols) {
    const int64_t blocks = (N + out_cols - 1) / out_cols;
    const int threads = omp_get_max_threads();
    return sf_split::split(M, blocks, MR, threads, threads > 1 && M * blocks * NB * K >= kParallelMacs);
}

// Runs item(b, m0, rows, n0, cols, next) for every (column block b, row chunk from m0) of a call
// over the OpenMP pool: rows [m0, m0 + rows) of x, output columns [n0, n0 + cols); `next` is the
// column block of the item after it (the one its thread most likely runs next), or -1.
template <typename Item>
inline void for_each_item(int64_t M, int64_t N, int64_t k_cost, int64_t out_cols, Item&& item) {
    const sf_split::Split sp = split_work(M, N, k_cost, out_cols);
#pragma omp parallel for schedule(static) if (sp.par)
    for (int64_t it = 0; it < sp.items; ++it) {
        const int64_t b = it % sp.blocks, m0 = (it / sp.blocks) * sp.chunk_rows;
        if (m0 >= M) continue;
        const int64_t n0 = b * out_cols;
        item(b, m0, M - m0 < sp.chunk_rows ? M - m0 : sp.chunk_rows, n0, N - n0 < out_cols ? N - n0 : out_cols,
             sp.next_block(it, M));
    }
}

// y [M, N] from x [M, K]; N counts output columns (GATED: the intermediate size, half the
// packed weight's columns).
// `add`: what the rows add to their sums (GATED: before SwiGLU) as each block is stored.
template <typename T, bool GATED>
void linear(const T* x, int64_t sx, const T* w, int64_t N, int64_t K, const float* bias, T* y, int64_t sy,
            int64_t M, const Addend<T>& add = {}) {
    if (M <= 0 || N <= 0) return;
    constexpr int64_t out_cols = GATED ? NB / 2 : NB;  // output columns per block
    const int64_t block_elems = (sizeof(T) == 2 ? (K + 1) / 2 * 2 : K) * NB;
    const int64_t steps = sizeof(T) == 2 ? (K + 1) / 2 : K;
    for_each_item(M, N, K, out_cols, [&](int64_t b, int64_t m0, int64_t rows, int64_t n0, int64_t cols, int64_t next) {
        const T* wb = w + b * block_elems;
        const T* wn = next < 0 ? nullptr : w + next * block_elems;
        const float* bb = bias == nullptr ? nullptr : bias + b * NB;
        const float* d = add.any() ? block_addend<T, GATED>(add, N, m0, rows, n0, cols) : nullptr;
        const int64_t* row_slot = add.lora == nullptr ? nullptr : add.lora->row_slot + m0;
        for_each_strip<MR>(rows, [=](auto r, int64_t m) {
            constexpr int R = decltype(r)::value;
            vf acc[MR][NV];
            strip<R>(x + (m0 + m) * sx, sx, wb, K, acc,
                     Spread(sf_ahead::strip_share<MR>(wn, block_elems * int64_t(sizeof(T)), m, rows), steps));
            store<T, R, GATED>(acc, bb, y + (m0 + m) * sy + n0, sy, cols, d == nullptr ? nullptr : d + m * NB,
                               row_slot == nullptr ? nullptr : row_slot + m);
        });
    });
}

template <typename T, bool GATED>
void linear_packed(const int64_t* a, const Addend<T>& add = {}) {
    linear<T, GATED>(reinterpret_cast<const T*>(a[0]), a[1], reinterpret_cast<const T*>(a[2]), a[3], a[4],
                     reinterpret_cast<const float*>(a[5]), reinterpret_cast<T*>(a[6]), a[7], a[8], add);
}

#if SF_LIN_INT8
// The int8 form: x u8 [M, K] (zero point zp) with per-row scales xscale [M]; w s8 packed with
// per-column weight sums, weight scales and bias (float32, or null) in the packed column order.
template <typename T, bool GATED>
void linear_i8(const uint8_t* x, int64_t sx, const float* xscale, int32_t zp, const int8_t* w, const int32_t* colsum,
               const float* wscale, const float* bias, int64_t N, int64_t K, T* y, int64_t sy, int64_t M,
               const Addend<T>& add = {}) {
    if (M <= 0 || N <= 0) return;
    constexpr int64_t out_cols = GATED ? NB / 2 : NB;
    const int64_t block_elems = (K + 3) / 4 * 4 * NB;
    // A quad of int8 costs about a bf16 pair: K / 2 for the parallel threshold.
    for_each_item(M, N, K / 2, out_cols, [&](int64_t b, int64_t m0, int64_t rows, int64_t n0, int64_t cols, int64_t next) {
        const int8_t* wb = w + b * block_elems;
        const int8_t* wn = next < 0 ? nullptr : w + next * block_elems;
        const float* bb = bias == nullptr ? nullptr : bias + b * NB;
        const float* d = add.any() ? block_addend<T, GATED>(add, N, m0, rows, n0, cols) : nullptr;
        const int64_t* row_slot = add.lora == nullptr ? nullptr : add.lora->row_slot + m0;
        for_each_strip<MR>(rows, [=](auto r, int64_t m) {
            constexpr int R = decltype(r)::value;
            vf acc[MR][NV];
            strip_i8<R>(x + (m0 + m) * sx, sx, wb, K, colsum + b * NB, zp, wscale + b * NB, xscale + m0 + m, acc,
                        Spread(sf_ahead::strip_share<MR>(wn, block_elems, m, rows), (K + 3) / 4));
            store<T, R, GATED>(acc, bb, y + (m0 + m) * sy + n0, sy, cols, d == nullptr ? nullptr : d + m * NB,
                               row_slot == nullptr ? nullptr : row_slot + m);
        });
    });
}

template <typename T, bool GATED>
void linear_i8_packed(const int64_t* a, const Addend<T>& add = {}) {
    linear_i8<T, GATED>(reinterpret_cast<const uint8_t*>(a[0]), a[1], reinterpret_cast<const float*>(a[2]),
                        static_cast<int32_t>(a[3]), reinterpret_cast<const int8_t*>(a[4]),
                        reinterpret_cast<const int32_t*>(a[5]), reinterpret_cast<const float*>(a[6]),
                        reinterpret_cast<const float*>(a[7]), a[8], a[9], reinterpret_cast<T*>(a[10]), a[11], a[12],
                        add);
}
#endif

// run(T{}) with the output dtype an entry point's `bf16` flag names (bf16: uint16_t, else float).
template <typename Run>
inline void with_dtype(int bf16, Run&& run) {
    if (bf16)
        run(uint16_t{});
    else
        run(float{});
}

}  // namespace

extern "C" {

// Output columns per packed weight block.
int sf_lin_block_width(void) { return NB; }
// 1 when bf16 products use vdpbf16ps (AVX-512 BF16), 0 when they are widened to fp32.
int sf_lin_native_bf16(void) { return SF_LIN_BF16_DOT; }

// Packed arguments (one pointer to int64 slots, as the Python wrapper builds them):
// x, x row stride, packed w, N (output columns), K, bias (float32 in the packed column order,
// padded to whole blocks, or 0), y, y row stride, M.
void sf_lin_linear_f32_packed(const int64_t* a) { linear_packed<float, false>(a); }
void sf_lin_linear_bf16_packed(const int64_t* a) { linear_packed<uint16_t, false>(a); }
// The same for a gated (SwiGLU) weight: y = silu(x . gate^T) * (x . up^T), N = the intermediate size.
void sf_lin_linear_silu_mul_f32_packed(const int64_t* a) { linear_packed<float, true>(a); }
void sf_lin_linear_silu_mul_bf16_packed(const int64_t* a) { linear_packed<uint16_t, true>(a); }

// 1 when the int8 entry points below compute (AVX-512 VNNI or AVX2 builds); elsewhere they do nothing.
int sf_lin_has_int8(void) { return SF_LIN_INT8; }
// What the int8 products run on: 1 AVX-512 VNNI, 2 AVX-VNNI (256-bit), 3 AVX2 vpmaddubsw, 0 none.
int sf_lin_int8_products(void) { return SF_LIN_VNNI ? 1 : SF_LIN_AVXVNNI ? 2 : SF_LIN_AVX2 ? 3 : 0; }

// int8: x u8, x row stride, x row scales (float32 [M]), zero point, packed s8 w, column weight
// sums (int32), weight scales (float32), bias (float32 or 0), N (output columns), K, y, y row
// stride, M. Output float32 or bf16; `silu_mul`: a gated weight, as above.
#if SF_LIN_INT8
void sf_lin_linear_i8_f32_packed(const int64_t* a) { linear_i8_packed<float, false>(a); }
void sf_lin_linear_i8_bf16_packed(const int64_t* a) { linear_i8_packed<uint16_t, false>(a); }
void sf_lin_linear_i8_silu_mul_f32_packed(const int64_t* a) { linear_i8_packed<float, true>(a); }
void sf_lin_linear_i8_silu_mul_bf16_packed(const int64_t* a) { linear_i8_packed<uint16_t, true>(a); }
#else
void sf_lin_linear_i8_f32_packed(const int64_t*) {}
void sf_lin_linear_i8_bf16_packed(const int64_t*) {}
void sf_lin_linear_i8_silu_mul_f32_packed(const int64_t*) {}
void sf_lin_linear_i8_silu_mul_bf16_packed(const int64_t*) {}
#endif

// Any of the forms above (bf16: the bf16 form; gated: silu_mul; int8: the int8 form's arguments)
// with its rows' LoRA deltas (lora_simd.h: sf_lora::Deltas) added to the sums: for decoder.cpp.
void sf_lin_linear_lora_packed(const int64_t* a, int bf16, int gated, int int8, const void* lora) {
    const auto* deltas = static_cast<const sf_lora::Deltas*>(lora);
    auto run = [&](auto t) {
        using T = decltype(t);
        Addend<T> add;
        add.lora = deltas;
        if (int8) {
#if SF_LIN_INT8
            (gated ? linear_i8_packed<T, true> : linear_i8_packed<T, false>)(a, add);
#endif
        } else {
            (gated ? linear_packed<T, true> : linear_packed<T, false>)(a, add);
        }
    };
    with_dtype(bf16, run);
}

// The float forms above (bf16: the bf16 form; gated: silu_mul) with a dense addend [M, the
// unfused output's columns] in the output's dtype (row stride `stride`; gated: gate columns, then
// up) added to the sums: the Python layers' LoRA deltas for a gated gate_up.
void sf_lin_linear_addend_packed(const int64_t* a, int bf16, int gated, const void* addend, int64_t stride) {
    auto run = [&](auto t) {
        using T = decltype(t);
        Addend<T> add;
        add.dense = static_cast<const T*>(addend);
        add.dense_stride = stride;
        (gated ? linear_packed<T, true> : linear_packed<T, false>)(a, add);
    };
    with_dtype(bf16, run);
}

}  // extern "C"
