// Linear layers over llama.cpp's quantized blocks, kept packed in memory and widened in
// registers: y[M, N] = x[M, K] . W[N, K]^T (+ bias), x and y float32, W one of GGUF's block
// types (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: gguf_blocks.h has their packed layout
// and widening; splitfuse/kernels/cpu/quant4.py packs them and documents the API). The packed
// weight is column blocks of NB = 4 vectors (linear.cpp's blocks: 64 columns with AVX-512, 32
// with AVX2), each a run of records (32 k, or a K-quant's 256), so a block streams its weights
// (about the file's bytes) in order. Padding columns have zero scales and q = 0.
//
// Each work item (column block, row chunk) widens KC k of its block at a time into a float
// buffer in L1 (the weights as the `gguf` package dequantizes them, bit for bit: the products
// and sums are kept apart where numpy rounds them apart), then runs linear.cpp's float32
// register strips (MR rows x NB columns) over it, the strips' sums parked between chunks. Every
// output is one sequential multiply-add chain over k, as linear.cpp's float32 kernel computes
// it over the dequantized weight: the results equal that kernel's bit for bit, and the widening
// is done once per call whatever the row count. A gated (SwiGLU gate_up) weight has linear.cpp's
// gated blocks (NB / 2 gate columns, then the matching up columns) and stores silu(gate) * up.
//
// The vector code is GCC vector extensions (elementwise_simd.h), so AVX-512, AVX2 and narrower
// builds share it: the byte -> int32 widening compiles to vpmovzxbd / vpmovsxbd where the
// compiler targets AVX2 or AVX-512.
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "elementwise_simd.h"
#include "gguf_blocks.h"
#include "lora_simd.h"
#include "prefetch_ahead.h"
#include "work_split.h"
#include "sf_api.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

using namespace sf_ew;

namespace {

using namespace sf_gguf;

constexpr int MR = SF_EW_NATIVE_VW == 16 ? 6 : 2;  // rows per register strip (linear.cpp's)
constexpr int KC = 64;       // k widened per pass: KC x NB floats (16 KB with AVX-512) stay in L1
constexpr int64_t kParallelMacs = 1 << 15;

// Rows x[0..R) (row stride sx) times the widened weights w[0..kn)[NB], added to acc: linear.cpp's
// float32 strip, the same chain of multiply-adds.
template <int R>
inline void strip(const float* x, int64_t sx, const float* w, int64_t kn, vf (&acc)[MR][NV]) {
    for (int64_t k = 0; k < kn; ++k) {
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

// Sums (+ bias, + the rows' LoRA deltas lora_d where given: sf_lora::block_addend's, added to
// rows whose row_slot is not -1) of rows [0..R) to y's columns [0..cols) of this block; GATED as
// linear.cpp's store (each sum rounded as the unfused projection would store it, then
// silu(gate) * up).
template <int R, bool GATED>
inline void store(vf (&acc)[MR][NV], const float* bias, float* y, int64_t sy, int64_t cols,
                  const float* lora_d = nullptr, const int64_t* row_slot = nullptr) {
    constexpr int OUT = GATED ? NV / 2 : NV;
    for (int r = 0; r < R; ++r) {
        if (bias != nullptr)
            for (int j = 0; j < NV; ++j) acc[r][j] += loadu(bias + j * VW);
        if (lora_d != nullptr && (row_slot == nullptr || row_slot[r] >= 0))
            for (int j = 0; j < NV; ++j) acc[r][j] += loadu(lora_d + r * NB + j * VW);
        vf o[OUT];
        for (int j = 0; j < OUT; ++j)
            o[j] = GATED ? silu_mul<float>(round_to<float>(acc[r][j]), round_to<float>(acc[r][j + OUT])) : acc[r][j];
        if (cols == OUT * VW) {
            for (int j = 0; j < OUT; ++j) storeu(y + r * sy + j * VW, o[j]);
        } else {
            float tmp[OUT * VW];
            for (int j = 0; j < OUT; ++j) storeu(tmp + j * VW, o[j]);
            for (int64_t c = 0; c < cols; ++c) y[r * sy + c] = tmp[c];
        }
    }
}

// The packed bytes a thread widens after the k chunk it is on: its block's next chunk (from
// next_k0, at most kc), else the first chunk of the next item's block (next_b, or -1: none).
inline sf_ahead::Share next_chunk(const uint8_t* w, const uint8_t* wb, int64_t block_bytes, int64_t record,
                                  int64_t K, int64_t next_k0, int64_t kc, int64_t next_b) {
    const auto bytes = [](const uint8_t* p) { return reinterpret_cast<const char*>(p); };
    if (next_k0 < K) return {bytes(wb + next_k0 / QK * record), (K - next_k0 < kc ? K - next_k0 : kc) / QK * record};
    if (next_b >= 0) return {bytes(w + next_b * block_bytes), (K < kc ? K : kc) / QK * record};
    return {};
}

template <int KIND, bool GATED>
void linear(const float* x, int64_t sx, const uint8_t* w, int64_t N, int64_t K, const float* bias, float* y,
            int64_t sy, int64_t M, const sf_lora::Deltas* lora = nullptr) {
    if (M <= 0 || N <= 0 || K <= 0) return;
    constexpr int64_t out_cols = GATED ? NB / 2 : NB;
    constexpr int64_t per_group = record_bytes(KIND) / groups_per_record(KIND);  // on average, for prefetching
    const int64_t block_bytes = K / record_k(KIND) * record_bytes(KIND);
    const int64_t blocks = (N + out_cols - 1) / out_cols;
    // Column blocks over the threads, rows cut into chunks where they alone do not share evenly
    // (work_split.h; each chunk widens its block again).
    const int threads = omp_get_max_threads();
    const sf_split::Split sp = sf_split::split(M, blocks, MR, threads, M * blocks * NB * K >= kParallelMacs);
    const int64_t chunk_rows = sp.chunk_rows, items = sp.items;
#pragma omp parallel if (sp.par)
    {
        alignas(64) float buf[KC * NB];
        std::vector<float> parked;  // the strips' sums between k passes: [chunk_rows][NB]
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; ++it) {
            const int64_t b = it % blocks, m0 = (it / blocks) * chunk_rows;
            if (m0 >= M) continue;
            const int64_t rows = M - m0 < chunk_rows ? M - m0 : chunk_rows;
            const int64_t n0 = b * out_cols, cols = N - n0 < out_cols ? N - n0 : out_cols;
            const uint8_t* wb = w + b * block_bytes;
            const float* bb = bias == nullptr ? nullptr : bias + b * NB;
            if (static_cast<int64_t>(parked.size()) < rows * NB) parked.resize(rows * NB);
            for (int64_t k0 = 0; k0 < K; k0 += KC) {
                const int64_t kn = K - k0 < KC ? K - k0 : KC;
                for (int64_t g = 0; g < kn / QK; ++g) {
                    const int64_t gi = k0 / QK + g;
                    widen_group<KIND>(wb + gi / groups_per_record(KIND) * record_bytes(KIND),
                                      static_cast<int>(gi % groups_per_record(KIND)), buf + g * QK * NB);
                }
                const bool first = k0 == 0, last = k0 + kn >= K;
                const float* d = last && lora != nullptr
                                     ? sf_lora::block_addend<float, GATED>({lora}, N, m0, rows, n0, cols) : nullptr;
                const int64_t* row_slot = lora == nullptr ? nullptr : lora->row_slot + m0;
                const sf_ahead::Share next =
                    next_chunk(w, wb, block_bytes, per_group, K, k0 + KC, KC, sp.next_block(it, M));
                for_each_strip<MR>(rows, [&](auto r, int64_t m) {
                    constexpr int R = decltype(r)::value;
                    sf_ahead::fetch(sf_ahead::strip_share<MR>(next.p, next.bytes, m, rows));
                    vf acc[MR][NV];
                    float* park = parked.data() + m * NB;
                    for (int i = 0; i < R; ++i)
                        for (int j = 0; j < NV; ++j) acc[i][j] = first ? vf{} : loadu(park + i * NB + j * VW);
                    strip<R>(x + (m0 + m) * sx + k0, sx, buf, kn, acc);
                    if (last) {
                        store<R, GATED>(acc, bb, y + (m0 + m) * sy + n0, sy, cols, d == nullptr ? nullptr : d + m * NB,
                                        row_slot == nullptr ? nullptr : row_slot + m);
                    } else {
                        for (int i = 0; i < R; ++i)
                            for (int j = 0; j < NV; ++j) storeu(park + i * NB + j * VW, acc[i][j]);
                    }
                });
            }
        }
    }
}

// ---- The integer form (`dot`): activations quantized per 32-k group, products in int8 ----
//
// As llama.cpp multiplies these blocks: each row's 32-k groups of x are quantized to int8
// (xq = round(x / s), s = max|x| / 127, in this call), and a group's products are exact int32
// sums of 4-bit (or 8-bit) weights times xq, scaled once per group:
//   Q4_0: d * s * (sum q xq - 8 sum xq)     Q4_1: d * s * sum q xq + m * sum x
//   Q8_0: d * s * sum w xq
// vpdpbusd (AVX-512 VNNI) takes the weight bytes as its unsigned operand (Q4: 0..15; Q8_0 stored
// as w + 128, the 128 * sum xq taken off per group). AVX2 has vpmaddubsw: Q4's pair sums (at
// most 2 * 15 * 127) cannot saturate its int16; Q8_0 goes in as |w| against xq * sign(w)
// (vpsignb; at most 2 * 128 * 127 < 32768), then vpmaddwd sums the pairs into int32.
// A group costs 8 dot products per (row, vector) against the float form's 32 multiply-adds; the
// results differ from the float model's by the activations' rounding (reported agreement, not
// bit equality). Packed layout per (column block, group): d[NB] fp16, (Q4_1: m[NB] fp16), then
// 8 quads of k, each NV vectors of VW columns x 4 consecutive k (byte 4 i + e: column i, k 4 quad
// + e, vpdpbusd's order); Q4 packs vectors 2c and 2c + 1 as the low and high nibbles of one chunk.
// Q5_0, Q5_1 and the K-quants: gguf_blocks.h's record header, and per group the low nibbles in
// that quad layout, then the high bits in planes (high_at_4). Their integers are
// 0..63 (Q6_K's and Q5_0's offsets taken off per group as Q4_0's, through sum xq), so the AVX2
// pair sums stay below 2 * 63 * 127; Q6_K's two 16-k halves are summed and scaled apart:
//   Q5_0: d s (sum q xq - 16 sum xq)      Q5_1: d s sum q xq + m sum x
//   Q4_K, Q5_K: d sc s sum q xq - dmin mn sum x      Q6_K: per half, d sc s (sum q xq - 32 sum xq)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && SF_EW_VW == 16 && SF_EW_NATIVE_VW == 16
#define SF_Q4_DOT 1  // 512-bit vpdpbusd
#elif defined(__AVX2__) && SF_EW_VW == 8 && SF_EW_NATIVE_VW == 8
#define SF_Q4_DOT 2  // 256-bit vpmaddubsw + vpmaddwd
#else
#define SF_Q4_DOT 0  // the float form only
#endif

#if SF_Q4_DOT
#ifndef SF_Q4_DOT_MR  // test override: -DSF_Q4_DOT_MR=n
// 3 with AVX-512: 12 int32 and 12 float sums stay in the 32 registers (4 rows spilled them:
// a SmolLM2 layer's four projections at 16 rows, one Zen 5 thread, 289 -> 232 us).
#define SF_Q4_DOT_MR (SF_Q4_DOT == 1 ? 3 : 2)
#endif
constexpr int DOT_MR = SF_Q4_DOT_MR;  // rows per strip: int and float sums in registers
constexpr int DOT_KC = 256;                     // k unpacked per pass: KC x NB bytes in L1
constexpr int GQ = QK / 4;                      // quads per group
constexpr int DOT_KINDS = (1 << NKINDS) - 1;     // kinds with this form: all
#if SF_Q4_DOT == 1
typedef __m512i ivec;
#else
typedef __m256i ivec;
#endif

// Q4_0's, Q5_0's, Q6_K's and Q8_0's (VNNI: stored w + 128) offsets of the unsigned weight byte.
template <int KIND>
constexpr int32_t weight_offset() {
    return KIND == Q4_0 ? 8 : KIND == Q5_0 ? 16 : KIND == Q6_K ? 32 : (KIND == Q8_0 && SF_Q4_DOT == 1) ? 128 : 0;
}
// Scale sets per group: Q6_K's two 16-k halves each have their own.
template <int KIND>
constexpr int halves() { return KIND == Q6_K ? 2 : 1; }
// Kinds with a per-group term in sum x: + m sum x (Q4_1, Q5_1), - dmin mn sum x (Q4_K, Q5_K).
template <int KIND>
constexpr bool has_min() { return KIND == Q4_1 || KIND == Q5_1 || KIND == Q4_K || KIND == Q5_K; }

inline ivec load_iv(const void* p) {
#if SF_Q4_DOT == 1
    return _mm512_loadu_si512(p);
#else
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
#endif
}
inline void store_iv(void* p, ivec v) {
#if SF_Q4_DOT == 1
    _mm512_storeu_si512(p, v);
#else
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
#endif
}

// Rows of x quantized per 32-k group: xq [M][K] int8, and per (row, group) s, sum x, sum xq
// and sum xq per 16-k half (Q6_K's sub-blocks).
struct QuantRows {
    std::vector<int8_t> q;
    std::vector<float> scale, sum;
    std::vector<int32_t> qsum, qhalf;

    QuantRows(int64_t M, int64_t K)
        : q(M * K), scale(M * K / QK), sum(M * K / QK), qsum(M * K / QK), qhalf(2 * M * K / QK) {}
};

// VW int32 lanes (in [-127, 127]) stored as VW bytes: one vpmovdb on AVX-512, two packs on AVX2.
inline void store_i8(int8_t* p, vi v) {
#if SF_Q4_DOT == 1
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(reinterpret_cast<__m512i>(v)));
#else
    const __m256i w = _mm256_packs_epi32(reinterpret_cast<__m256i>(v), reinterpret_cast<__m256i>(v));  // per lane
    const __m256i b = _mm256_packs_epi16(w, w);
    const int32_t lo = _mm256_extract_epi32(b, 0), hi = _mm256_extract_epi32(b, 4);
    std::memcpy(p, &lo, 4);
    std::memcpy(p + 4, &hi, 4);
#endif
}

inline void quantize_row(const float* x, int64_t K, int8_t* q, float* scale, float* sum, int32_t* qsum,
                         int32_t* qhalf) {
    for (int64_t g = 0; g < K / QK; ++g) {
        const float* xg = x + g * QK;
        vf amax{}, total{};
        vf v[QK / VW];
        for (int i = 0; i < QK / VW; ++i) {
            v[i] = loadu(xg + i * VW);
            const vf a = v[i] < 0 ? -v[i] : v[i];
            amax = a > amax ? a : amax;
            total += v[i];
        }
        float m = 0.0f, t = 0.0f, lanes[VW], sums[VW];
        std::memcpy(lanes, &amax, sizeof(lanes));
        std::memcpy(sums, &total, sizeof(sums));
        for (int i = 0; i < VW; ++i) {
            m = lanes[i] > m ? lanes[i] : m;
            t += sums[i];
        }
        const float s = m / 127.0f, inv = m > 0.0f ? 127.0f / m : 0.0f;
        vi qs[2] = {};  // per 16-k half
        for (int i = 0; i < QK / VW; ++i) {
            // Nearest (ties to even) by the 1.5 * 2^23 trick on the rounded product (a fused
            // multiply-add would round ties differently from torch.round(x * inv)); |x * inv| <= 127.
            const vf r = (rounded(v[i] * inv) + 12582912.0f) - 12582912.0f;
            const vi qi = __builtin_convertvector(r, vi);
            qs[i * VW / 16] += qi;
            store_i8(q + g * QK + i * VW, qi);
        }
        int32_t qt[2] = {}, qlanes[VW];
        for (int h = 0; h < 2; ++h) {
            std::memcpy(qlanes, &qs[h], sizeof(qlanes));
            for (int i = 0; i < VW; ++i) qt[h] += qlanes[i];
            qhalf[2 * g + h] = qt[h];
        }
        scale[g] = s;
        sum[g] = t;
        qsum[g] = qt[0] + qt[1];
    }
}

// Vector j of quad qd's high bits (HB per weight), moved to bits [4, 4 + HB) of each byte: the
// group's planes (gguf_layout._planes) hold Q = 8 / (NV HB) quads each, slot (qd % Q) NV + j at
// bits [slot HB, slot HB + HB) of each byte; a 16-bit shift by at most 4 keeps every byte's bits
// within it once masked.
template <int HB>
inline ivec high_at_4(const uint8_t* planes, int qd, int j) {
    constexpr int Q = 8 / (NV * HB), VB = 4 * VW;
    const ivec plane = load_iv(planes + (qd / Q) * VB);
    const int shift = 4 - ((qd % Q) * NV + j) * HB;  // left if positive
#if SF_Q4_DOT == 1
    const ivec moved = shift >= 0 ? _mm512_slli_epi16(plane, shift) : _mm512_srli_epi16(plane, -shift);
    return _mm512_and_si512(moved, _mm512_set1_epi8(((1 << HB) - 1) << 4));
#else
    const ivec moved = shift >= 0 ? _mm256_slli_epi16(plane, shift) : _mm256_srli_epi16(plane, -shift);
    return _mm256_and_si256(moved, _mm256_set1_epi8(((1 << HB) - 1) << 4));
#endif
}

// Quad qd's NV weight vectors of a group whose quants start at q (high bits at q + QK NB / 2):
// bytes the integers (Q4: 0..15, with high bits 0..63; Q8_0 with VNNI: w + 128); Q8_0 on AVX2:
// |w| in w, and the signed weights in ws (unset for every other case).
template <int KIND>
inline void quad_weights(const uint8_t* q, int qd, ivec (&w)[NV], ivec (&ws)[NV]) {
    constexpr int HB = high_bits(KIND), VB = 4 * VW;
    if constexpr (KIND == Q8_0) {
        for (int j = 0; j < NV; ++j) {
            const ivec raw = load_iv(q + (qd * NV + j) * VB);
#if SF_Q4_DOT == 1
            w[j] = raw;
            (void)ws;
#else
            ws[j] = _mm256_xor_si256(raw, _mm256_set1_epi8(static_cast<char>(0x80)));  // w
            w[j] = _mm256_abs_epi8(ws[j]);
#endif
        }
    } else {
        (void)ws;
        const uint8_t* hq = q + QK * NB / 2;
        for (int c = 0; c < NV / 2; ++c) {
            const ivec v = load_iv(q + (qd * NV / 2 + c) * VB);
#if SF_Q4_DOT == 1
            ivec nib[2] = {_mm512_and_si512(v, _mm512_set1_epi8(15)),
                           _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15))};
#else
            ivec nib[2] = {_mm256_and_si256(v, _mm256_set1_epi8(15)),
                           _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15))};
#endif
            for (int h = 0; h < 2; ++h) {
                const int j = 2 * c + h;
                if constexpr (HB > 0) {
#if SF_Q4_DOT == 1
                    nib[h] = _mm512_or_si512(nib[h], high_at_4<HB>(hq, qd, j));
#else
                    nib[h] = _mm256_or_si256(nib[h], high_at_4<HB>(hq, qd, j));
#endif
                }
                w[j] = nib[h];
            }
        }
    }
}

// A group's quants in a record: after the header, `sub` groups in.
template <int KIND>
inline const uint8_t* group_quants(const uint8_t* rec, int sub) {
    return rec + head_bytes(KIND) * NB + sub * group_bytes(KIND);
}

// Group `sub` of record `rec`: a [halves][NB] its scales (d, or d sc), b [NB] its minimum
// term's (m, or dmin mn), as floats.
template <int KIND>
inline void group_factors(const uint8_t* rec, int sub, vf (&a)[NV], vf (&a2)[NV], vf (&b)[NV]) {
    if constexpr (KIND == Q4_0 || KIND == Q4_1 || KIND == Q8_0) {
        const uint16_t* h = reinterpret_cast<const uint16_t*>(rec);
        load_scales(h, a);
        if constexpr (KIND == Q4_1) load_scales(h + NB, b);
    } else {
        group_scales<KIND>(rec, sub, a, a2, b);
    }
}

// One group unpacked into the pass buffer: wq [GQ][NV] vectors of bytes (Q8_0 on AVX2: |w|, and
// the signed w in ws), a [halves][NB] and b [NB] as group_factors'.
template <int KIND>
inline void unpack_group(const uint8_t* rec, int sub, uint8_t* wq, uint8_t* ws, float* a, float* b) {
    constexpr int VB = 4 * VW;
    vf av[NV], a2[NV], bv[NV];
    group_factors<KIND>(rec, sub, av, a2, bv);
    for (int j = 0; j < NV; ++j) {
        storeu(a + j * VW, av[j]);
        if constexpr (halves<KIND>() == 2) storeu(a + NB + j * VW, a2[j]);
        if constexpr (has_min<KIND>()) storeu(b + j * VW, bv[j]);
    }
    const uint8_t* q = group_quants<KIND>(rec, sub);
    for (int qd = 0; qd < GQ; ++qd) {
        ivec w[NV], sw[NV];
        quad_weights<KIND>(q, qd, w, sw);
        for (int j = 0; j < NV; ++j) {
            store_iv(wq + (qd * NV + j) * VB, w[j]);
            if constexpr (KIND == Q8_0 && SF_Q4_DOT == 2) store_iv(ws + (qd * NV + j) * VB, sw[j]);
        }
    }
}

// s += the 4-k dot products of weight bytes w (unsigned; Q8_0 on AVX2: |w|, with ws the signed
// weights) and the broadcast xq quad xb.
template <int KIND>
inline ivec dot4(ivec s, ivec w, ivec ws, ivec xb) {
#if SF_Q4_DOT == 1
    (void)ws;
    return _mm512_dpbusd_epi32(s, w, xb);
#else
    const ivec x = KIND == Q8_0 ? _mm256_sign_epi8(xb, ws) : xb;
    return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}

// Four int8 activations (one quad of k) in every 32-bit lane.
inline ivec broadcast_quad(const int8_t* p) {
    int32_t quad;
    std::memcpy(&quad, p, 4);
#if SF_Q4_DOT == 1
    return _mm512_set1_epi32(quad);
#else
    return _mm256_set1_epi32(quad);
#endif
}

// acc += a group's (or half's) integer sums s, less the weights' offset times sum xq (corr),
// times the weights' scale a and the activations' xs; then the minimum's term (b: m, or dmin mn)
// times the group's sum x.
template <int KIND>
inline void scale_in(vf& acc, ivec s, int32_t corr, vf a, float xs) {
    vi si;
    std::memcpy(&si, &s, sizeof(si));
    if constexpr (weight_offset<KIND>() != 0) si -= corr;
    acc += __builtin_convertvector(si, vf) * (a * xs);
}
template <int KIND>
inline void min_in(vf& acc, vf b, float xsum) {
    if constexpr (KIND == Q4_1 || KIND == Q5_1)
        acc += b * xsum;
    else if constexpr (has_min<KIND>())
        acc -= b * xsum;
}

// The offset correction of half h of row `row`'s group (row * G + group).
template <int KIND>
inline int32_t offset_sum(const QuantRows& xr, int64_t row, int h) {
    return weight_offset<KIND>() * (halves<KIND>() == 2 ? xr.qhalf[2 * row + h] : xr.qsum[row]);
}

// Rows [0..R) of the quantized x (from row m, k0) against the pass's unpacked groups, into acc.
template <int KIND, int R>
inline void dot_strip(const QuantRows& xr, int64_t K, int64_t m, int64_t k0, int64_t groups, const uint8_t* wq,
                      const uint8_t* ws, const float* dbuf, const float* mbuf, vf (&acc)[DOT_MR][NV]) {
    constexpr int VB = 4 * VW, H = halves<KIND>();
    const int64_t G = K / QK;
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t kg = k0 + g * QK, gi = kg / QK;
        for (int h = 0; h < H; ++h) {  // each half's integer sums scaled by its own scale
            ivec s[DOT_MR][NV];
            for (int r = 0; r < R; ++r)
                for (int j = 0; j < NV; ++j) s[r][j] = ivec{};
            for (int qd = h * GQ / H; qd < (h + 1) * GQ / H; ++qd) {
                ivec xb[DOT_MR];
                for (int r = 0; r < R; ++r) xb[r] = broadcast_quad(xr.q.data() + (m + r) * K + kg + 4 * qd);
                const int64_t off = ((g * GQ + qd) * NV) * VB;
                for (int j = 0; j < NV; ++j) {
                    const ivec w = load_iv(wq + off + j * VB);
                    const ivec sw = KIND == Q8_0 && SF_Q4_DOT == 2 ? load_iv(ws + off + j * VB) : w;
                    for (int r = 0; r < R; ++r) s[r][j] = dot4<KIND>(s[r][j], w, sw, xb[r]);
                }
            }
            for (int j = 0; j < NV; ++j) {  // each scale vector loaded once for the strip's rows
                const vf aj = loadu(dbuf + (g * H + h) * NB + j * VW);
                const vf bj = has_min<KIND>() ? loadu(mbuf + g * NB + j * VW) : vf{};
                for (int r = 0; r < R; ++r) {
                    const int64_t row = (m + r) * G + gi;
                    scale_in<KIND>(acc[r][j], s[r][j], offset_sum<KIND>(xr, row, h), aj, xr.scale[row]);
                    min_in<KIND>(acc[r][j], bj, xr.sum[row]);
                }
            }
        }
    }
}

// A lone row's software prefetch, spread over its quads: at one row the integer work per byte
// is too short for the hardware prefetchers alone to keep the stream full. Which level and how
// far ahead were measured per build (docs/gguf_blocks.md): into L1 starved the AVX-512 build's
// stream from memory, into L2 starved the AVX2 build's.
#if SF_Q4_DOT == 1
constexpr int ROW_PREFETCH_LOCALITY = 2;  // __builtin_prefetch's: 2 = prefetcht1
constexpr int64_t ROW_AHEAD = 8192;
#else
constexpr int ROW_PREFETCH_LOCALITY = 0;  // prefetchnta
constexpr int64_t ROW_AHEAD = 4096;
#endif

// One row of the quantized x against column block wb, straight from the packed records (no pass
// buffer: a lone row would unpack each weight only to read it once). The same operations in the
// same order as dot_strip's: equal sums, bit for bit.
template <int KIND>
inline void dot_row(const QuantRows& xr, int64_t K, const uint8_t* wb, vf (&acc)[NV]) {
    constexpr int H = halves<KIND>(), GPR = groups_per_record(KIND);
    constexpr int64_t per_group = record_bytes(KIND) / GPR;
    constexpr int lines = (per_group + 63) / 64;  // prefetched a few per quad, not in one burst
    for (int64_t gi = 0; gi < K / QK; ++gi) {
        const char* ahead = reinterpret_cast<const char*>(wb) + gi * per_group + ROW_AHEAD;
        const uint8_t* rec = wb + gi / GPR * record_bytes(KIND);
        const int sub = static_cast<int>(gi % GPR);
        vf a[NV], a2[NV], b[NV];
        group_factors<KIND>(rec, sub, a, a2, b);
        const uint8_t* q = group_quants<KIND>(rec, sub);
#pragma GCC unroll 2
        for (int h = 0; h < H; ++h) {
            ivec s[NV] = {};
#pragma GCC unroll 8
            for (int qd = h * GQ / H; qd < (h + 1) * GQ / H; ++qd) {
                for (int l = qd * lines / GQ; l < (qd + 1) * lines / GQ; ++l) __builtin_prefetch(ahead + 64 * l, 0, ROW_PREFETCH_LOCALITY);
                const ivec xb = broadcast_quad(xr.q.data() + gi * QK + 4 * qd);
                ivec w[NV], sw[NV];
                quad_weights<KIND>(q, qd, w, sw);
                for (int j = 0; j < NV; ++j) s[j] = dot4<KIND>(s[j], w[j], KIND == Q8_0 && SF_Q4_DOT == 2 ? sw[j] : w[j], xb);
            }
            for (int j = 0; j < NV; ++j) {
                scale_in<KIND>(acc[j], s[j], offset_sum<KIND>(xr, gi, h), h == 0 ? a[j] : a2[j], xr.scale[gi]);
                min_in<KIND>(acc[j], b[j], xr.sum[gi]);
            }
        }
    }
}

template <int R, bool GATED>
inline void store_dot(vf (&acc)[DOT_MR][NV], const float* bias, float* y, int64_t sy, int64_t cols,
                      const float* lora_d, const int64_t* row_slot) {
    vf tmp[MR][NV];
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < NV; ++j) tmp[r][j] = acc[r][j];
    store<R, GATED>(tmp, bias, y, sy, cols, lora_d, row_slot);
}

// One row (a lone sequence's decode step): column blocks over the threads, each straight from
// its packed records (dot_row).
template <int KIND, bool GATED>
void linear_dot_row(const float* x, const uint8_t* w, int64_t N, int64_t K, const float* bias, float* y,
                    const sf_lora::Deltas* lora) {
    constexpr int64_t out_cols = GATED ? NB / 2 : NB;
    const int64_t block_bytes = K / record_k(KIND) * record_bytes(KIND), blocks = (N + out_cols - 1) / out_cols;
    QuantRows xr(1, K);
    quantize_row(x, K, xr.q.data(), xr.scale.data(), xr.sum.data(), xr.qsum.data(), xr.qhalf.data());
#pragma omp parallel for schedule(static) if (blocks * NB * K >= 4 * kParallelMacs)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t n0 = b * out_cols, cols = N - n0 < out_cols ? N - n0 : out_cols;
        vf acc[DOT_MR][NV] = {};
        dot_row<KIND>(xr, K, w + b * block_bytes, acc[0]);
        const float* d = lora != nullptr ? sf_lora::block_addend<float, GATED>({lora}, N, 0, 1, n0, cols) : nullptr;
        store_dot<1, GATED>(acc, bias == nullptr ? nullptr : bias + b * NB, y + n0, 0, cols, d,
                            lora == nullptr ? nullptr : lora->row_slot);
    }
}

template <int KIND, bool GATED>
void linear_dot(const float* x, int64_t sx, const uint8_t* w, int64_t N, int64_t K, const float* bias, float* y,
                int64_t sy, int64_t M, const sf_lora::Deltas* lora = nullptr) {
    if (M <= 0 || N <= 0 || K <= 0) return;
    if (M == 1) return linear_dot_row<KIND, GATED>(x, w, N, K, bias, y, lora);
    constexpr int64_t out_cols = GATED ? NB / 2 : NB;
    const int64_t G = K / QK, block_bytes = K / record_k(KIND) * record_bytes(KIND);
    constexpr int64_t per_group = record_bytes(KIND) / groups_per_record(KIND);  // on average, for prefetching
    constexpr int GPR = groups_per_record(KIND), H = halves<KIND>();
    const int64_t blocks = (N + out_cols - 1) / out_cols;
    const int threads = omp_get_max_threads();
    const sf_split::Split sp = sf_split::split(M, blocks, DOT_MR, threads, M * blocks * NB * K >= 4 * kParallelMacs);
    const int64_t chunk_rows = sp.chunk_rows, items = sp.items;
    const bool par = sp.par;
    QuantRows xr(M, K);
#pragma omp parallel if (par)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; ++r)
            quantize_row(x + r * sx, K, xr.q.data() + r * K, xr.scale.data() + r * G, xr.sum.data() + r * G,
                         xr.qsum.data() + r * G, xr.qhalf.data() + 2 * r * G);
        alignas(64) uint8_t wq[DOT_KC * NB];
        alignas(64) uint8_t ws[KIND == Q8_0 && SF_Q4_DOT == 2 ? DOT_KC * NB : 1];
        alignas(64) float dbuf[DOT_KC / QK * NB * H], mbuf[has_min<KIND>() ? DOT_KC / QK * NB : 1];
        std::vector<float> parked;
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; ++it) {
            const int64_t b = it % blocks, m0 = (it / blocks) * chunk_rows;
            if (m0 >= M) continue;
            const int64_t rows = M - m0 < chunk_rows ? M - m0 : chunk_rows;
            const int64_t n0 = b * out_cols, cols = N - n0 < out_cols ? N - n0 : out_cols;
            const uint8_t* wb = w + b * block_bytes;
            const float* bb = bias == nullptr ? nullptr : bias + b * NB;
            if (static_cast<int64_t>(parked.size()) < rows * NB) parked.resize(rows * NB);
            for (int64_t k0 = 0; k0 < K; k0 += DOT_KC) {
                const int64_t groups = (K - k0 < DOT_KC ? K - k0 : DOT_KC) / QK;
                for (int64_t g = 0; g < groups; ++g) {
                    const int64_t gi = k0 / QK + g;
                    const uint8_t* rec = wb + gi / GPR * record_bytes(KIND);
                    unpack_group<KIND>(rec, static_cast<int>(gi % GPR), wq + g * QK * NB,
                                       ws + (KIND == Q8_0 && SF_Q4_DOT == 2 ? g * QK * NB : 0), dbuf + g * H * NB,
                                       mbuf + (has_min<KIND>() ? g * NB : 0));
                }
                const bool first = k0 == 0, last = k0 + groups * QK >= K;
                const float* d = last && lora != nullptr
                                     ? sf_lora::block_addend<float, GATED>({lora}, N, m0, rows, n0, cols) : nullptr;
                const int64_t* row_slot = lora == nullptr ? nullptr : lora->row_slot + m0;
                const sf_ahead::Share next =
                    next_chunk(w, wb, block_bytes, per_group, K, k0 + DOT_KC, DOT_KC, sp.next_block(it, M));
                for_each_strip<DOT_MR>(rows, [&](auto r, int64_t m) {
                    constexpr int R = decltype(r)::value;
                    sf_ahead::fetch(sf_ahead::strip_share<DOT_MR>(next.p, next.bytes, m, rows));
                    vf acc[DOT_MR][NV];
                    float* park = parked.data() + m * NB;
                    for (int i = 0; i < R; ++i)
                        for (int j = 0; j < NV; ++j) acc[i][j] = first ? vf{} : loadu(park + i * NB + j * VW);
                    dot_strip<KIND, R>(xr, K, m0 + m, k0, groups, wq, ws, dbuf, mbuf, acc);
                    if (last) {
                        store_dot<R, GATED>(acc, bb, y + (m0 + m) * sy + n0, sy, cols,
                                            d == nullptr ? nullptr : d + m * NB, row_slot == nullptr ? nullptr : row_slot + m);
                    } else {
                        for (int i = 0; i < R; ++i)
                            for (int j = 0; j < NV; ++j) storeu(park + i * NB + j * VW, acc[i][j]);
                    }
                });
            }
        }
    }
}

template <int KIND, bool GATED>
void linear_dot_packed(const int64_t* a, const sf_lora::Deltas* lora = nullptr) {
    linear_dot<KIND, GATED>(reinterpret_cast<const float*>(a[0]), a[1], reinterpret_cast<const uint8_t*>(a[2]),
                            a[3], a[4], reinterpret_cast<const float*>(a[5]), reinterpret_cast<float*>(a[6]), a[7],
                            a[8], lora);
}
#endif  // SF_Q4_DOT

template <int KIND, bool GATED>
void linear_packed(const int64_t* a, const sf_lora::Deltas* lora = nullptr) {
    linear<KIND, GATED>(reinterpret_cast<const float*>(a[0]), a[1], reinterpret_cast<const uint8_t*>(a[2]), a[3],
                        a[4], reinterpret_cast<const float*>(a[5]), reinterpret_cast<float*>(a[6]), a[7], a[8], lora);
}

}  // namespace

extern "C" {

// Output columns per packed block (linear.cpp's NB) and bytes per (block, record) by kind
// (gguf_blocks.h's Kind; a record covers 32 k, a K-quant's 256).
int sf_q4_block_width(void) { return NB; }
int64_t sf_q4_record_bytes(int kind) {
    static constexpr int64_t bytes[NKINDS] = {record_bytes(Q4_0), record_bytes(Q4_1), record_bytes(Q8_0),
                                              record_bytes(Q5_0), record_bytes(Q5_1), record_bytes(Q4_K),
                                              record_bytes(Q5_K), record_bytes(Q6_K)};
    return kind < 0 || kind >= NKINDS ? 0 : bytes[kind];
}

// Packed arguments (int64 slots): x, x row stride, packed w, N (output columns; a gated weight's
// intermediate size), K (a multiple of the kind's record k), bias (float32 in the packed column
// order, or 0), y, y row stride, M.
#define SF_Q4_FLOAT(name, KIND)                                                        \
    void sf_q4_linear_##name(const int64_t* a) { linear_packed<KIND, false>(a); } \
    void sf_q4_linear_silu_mul_##name(const int64_t* a) { linear_packed<KIND, true>(a); }
SF_Q4_FLOAT(q4_0, Q4_0)
SF_Q4_FLOAT(q4_1, Q4_1)
SF_Q4_FLOAT(q8_0, Q8_0)
SF_Q4_FLOAT(q5_0, Q5_0)
SF_Q4_FLOAT(q5_1, Q5_1)
SF_Q4_FLOAT(q4_k, Q4_K)
SF_Q4_FLOAT(q5_k, Q5_K)
SF_Q4_FLOAT(q6_k, Q6_K)
#undef SF_Q4_FLOAT

// The integer form: 1 AVX-512 VNNI, 2 AVX2 (vpmaddubsw), 0 absent (its entry points do nothing).
int sf_q4_dot_products(void) { return SF_Q4_DOT; }
// Which kinds have the integer form in this build: bit `kind` set.
#if SF_Q4_DOT
int sf_q4_dot_kinds(void) { return DOT_KINDS; }
#else
int sf_q4_dot_kinds(void) { return 0; }
#endif
// The same arguments, over weights packed for the integer form (quant4.py: form="dot").
#if SF_Q4_DOT
#define SF_Q4_DOT_FN(name, KIND)                                                     \
    void sf_q4_dot_##name(const int64_t* a) { linear_dot_packed<KIND, false>(a); } \
    void sf_q4_dot_silu_mul_##name(const int64_t* a) { linear_dot_packed<KIND, true>(a); }
#else
#define SF_Q4_DOT_FN(name, KIND)                 \
    void sf_q4_dot_##name(const int64_t*) {} \
    void sf_q4_dot_silu_mul_##name(const int64_t*) {}
#endif
SF_Q4_DOT_FN(q4_0, Q4_0)
SF_Q4_DOT_FN(q4_1, Q4_1)
SF_Q4_DOT_FN(q8_0, Q8_0)
SF_Q4_DOT_FN(q5_0, Q5_0)
SF_Q4_DOT_FN(q5_1, Q5_1)
SF_Q4_DOT_FN(q4_k, Q4_K)
SF_Q4_DOT_FN(q5_k, Q5_K)
SF_Q4_DOT_FN(q6_k, Q6_K)
#undef SF_Q4_DOT_FN

// Any of the above by number (kind: Kind; dot: the integer form; gated: silu_mul), plus the
// rows' LoRA deltas where `lora` (an sf_lora::Deltas) is given, for decoder.cpp's projections.
void sf_q4_linear_any(const int64_t* a, int kind, int dot, int gated, const void* lora) {
    const auto* e = static_cast<const sf_lora::Deltas*>(lora);
    using Fn = void (*)(const int64_t*, const sf_lora::Deltas*);
#define SF_Q4_ROW(G) {linear_packed<Q4_0, G>, linear_packed<Q4_1, G>, linear_packed<Q8_0, G>, linear_packed<Q5_0, G>, \
                      linear_packed<Q5_1, G>, linear_packed<Q4_K, G>, linear_packed<Q5_K, G>, linear_packed<Q6_K, G>}
    static constexpr Fn plain[2][NKINDS] = {SF_Q4_ROW(false), SF_Q4_ROW(true)};
#undef SF_Q4_ROW
#if SF_Q4_DOT
#define SF_Q4_ROW(G) {linear_dot_packed<Q4_0, G>, linear_dot_packed<Q4_1, G>, linear_dot_packed<Q8_0, G>, \
                      linear_dot_packed<Q5_0, G>, linear_dot_packed<Q5_1, G>, linear_dot_packed<Q4_K, G>, \
                      linear_dot_packed<Q5_K, G>, linear_dot_packed<Q6_K, G>}
    static constexpr Fn integer[2][NKINDS] = {SF_Q4_ROW(false), SF_Q4_ROW(true)};
#undef SF_Q4_ROW
#else
    static constexpr Fn integer[2][NKINDS] = {};
#endif
    if (kind < 0 || kind >= NKINDS) return;
    const Fn fn = (dot ? integer : plain)[gated ? 1 : 0][kind];
    if (fn != nullptr) fn(a, e);  // a kind without the integer form: the Python side never packs one
}

}  // extern "C"
