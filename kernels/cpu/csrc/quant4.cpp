// Linear layers over llama.cpp's quantized blocks, kept packed in memory and widened in
// registers: y[M, N] = x[M, K] . W[N, K]^T (+ bias), x and y float32, W one of GGUF's
//   Q4_0: per 32 k, an fp16 scale d and 4-bit q:         w = d * (q - 8)
//   Q4_1: per 32 k, fp16 scale d and minimum m, 4-bit q:  w = d * q + m
//   Q8_0: per 32 k, an fp16 scale d and int8 q:           w = d * q
// (splitfuse/kernels/cpu/quant4.py packs them and documents the API). The packed weight is
// column blocks of NB = 4 vectors (linear.cpp's blocks: 64 columns with AVX-512, 32 with AVX2),
// each a run of 32-k groups, each group one record:
//   d[NB] fp16, (Q4_1: m[NB] fp16), then for each of the 32 k:
//     Q4: NB / 2 bytes, NV / 2 chunks of VW bytes; byte i of chunk c holds column 2c*VW + i in
//         its low nibble and column (2c+1)*VW + i in its high nibble
//     Q8: NB int8, column j at byte j
// so a block streams its weights (about the file's bytes: 5 bits a weight for Q4_1) in order.
// Padding columns have d = m = 0 and q = 0. K is a multiple of 32 (GGUF's blocks).
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
#include "lora_simd.h"
#include "prefetch_ahead.h"
#include "work_split.h"
#include "sf_api.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

using namespace sf_ew;

namespace {

constexpr int NV = 4;        // vectors per column block (linear.cpp's)
constexpr int NB = NV * VW;  // columns per block
constexpr int MR = SF_EW_NATIVE_VW == 16 ? 6 : 2;  // rows per register strip (linear.cpp's)
constexpr int QK = 32;       // weights per GGUF block (along k)
constexpr int KC = 64;       // k widened per pass: KC x NB floats (16 KB with AVX-512) stay in L1
constexpr int64_t kParallelMacs = 1 << 15;

enum Kind { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };

template <int KIND>
constexpr int64_t record_bytes() {  // one group of one column block
    return (KIND == Q4_1 ? 4 : 2) * NB + (KIND == Q8_0 ? QK * NB : QK * NB / 2);
}

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

// The group record `rec` widened into buf[0..QK)[NB] (row k of NB floats).
template <int KIND>
inline void widen_group(const uint8_t* rec, float* buf) {
    vf d[NV], m[NV];
    load_scales(reinterpret_cast<const uint16_t*>(rec), d);
    if constexpr (KIND == Q4_1) load_scales(reinterpret_cast<const uint16_t*>(rec) + NB, m);
    const uint8_t* q = rec + (KIND == Q4_1 ? 4 : 2) * NB;
    for (int k = 0; k < QK; ++k) {
        float* out = buf + k * NB;
        if constexpr (KIND == Q8_0) {
            const int8_t* qk = reinterpret_cast<const int8_t*>(q) + k * NB;
            for (int j = 0; j < NV; ++j)
                storeu(out + j * VW, __builtin_convertvector(widen(qk + j * VW), vf) * d[j]);
        } else {
            const uint8_t* qk = q + k * (NB / 2);
            for (int c = 0; c < NV / 2; ++c) {
                const vi v = widen(qk + c * VW);
                const vi nib[2] = {v & 15, v >> 4};
                for (int h = 0; h < 2; ++h) {
                    const int j = 2 * c + h;
                    vf w;
                    if constexpr (KIND == Q4_0)
                        w = d[j] * __builtin_convertvector(nib[h] - 8, vf);
                    else  // numpy rounds d * q before adding m: no fused multiply-add here
                        w = rounded(d[j] * __builtin_convertvector(nib[h], vf)) + m[j];
                    storeu(out + j * VW, w);
                }
            }
        }
    }
}

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
    const int64_t groups = K / QK, block_bytes = groups * record_bytes<KIND>();
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
                for (int64_t g = 0; g < kn / QK; ++g)
                    widen_group<KIND>(wb + (k0 / QK + g) * record_bytes<KIND>(), buf + g * QK * NB);
                const bool first = k0 == 0, last = k0 + kn >= K;
                const float* d = last && lora != nullptr
                                     ? sf_lora::block_addend<float, GATED>({lora}, N, m0, rows, n0, cols) : nullptr;
                const int64_t* row_slot = lora == nullptr ? nullptr : lora->row_slot + m0;
                const sf_ahead::Share next =
                    next_chunk(w, wb, block_bytes, record_bytes<KIND>(), K, k0 + KC, KC, sp.next_block(it, M));
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
#if SF_Q4_DOT == 1
typedef __m512i ivec;
#else
typedef __m256i ivec;
#endif

template <int KIND>
constexpr int64_t dot_record_bytes() {
    return (KIND == Q4_1 ? 4 : 2) * NB + (KIND == Q8_0 ? QK * NB : QK * NB / 2);
}
// Q4_0's and Q8_0's (VNNI: stored w + 128) offsets of the unsigned weight byte.
template <int KIND>
constexpr int32_t weight_offset() {
    return KIND == Q4_0 ? 8 : (KIND == Q8_0 && SF_Q4_DOT == 1) ? 128 : 0;
}

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

// Rows of x quantized per 32-k group: xq [M][K] int8, and per (row, group) s, sum x, sum xq.
struct QuantRows {
    std::vector<int8_t> q;
    std::vector<float> scale, sum;
    std::vector<int32_t> qsum;
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

inline void quantize_row(const float* x, int64_t K, int8_t* q, float* scale, float* sum, int32_t* qsum) {
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
        vi qs{};
        for (int i = 0; i < QK / VW; ++i) {
            // Nearest (ties to even) by the 1.5 * 2^23 trick on the rounded product (a fused
            // multiply-add would round ties differently from torch.round(x * inv)); |x * inv| <= 127.
            const vf r = (rounded(v[i] * inv) + 12582912.0f) - 12582912.0f;
            const vi qi = __builtin_convertvector(r, vi);
            qs += qi;
            store_i8(q + g * QK + i * VW, qi);
        }
        int32_t qt = 0, qlanes[VW];
        std::memcpy(qlanes, &qs, sizeof(qlanes));
        for (int i = 0; i < VW; ++i) qt += qlanes[i];
        scale[g] = s;
        sum[g] = t;
        qsum[g] = qt;
    }
}

// One (column block, group) record unpacked into the pass buffer: wq [GQ][NV] vectors of bytes
// (Q8_0 on AVX2: |w|, and the signed w in ws), d and m as floats [NB].
template <int KIND>
inline void unpack_group(const uint8_t* rec, uint8_t* wq, uint8_t* ws, float* d, float* m) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(rec);
    vf dv[NV], mv[NV];
    load_scales(h, dv);
    for (int j = 0; j < NV; ++j) storeu(d + j * VW, dv[j]);
    if constexpr (KIND == Q4_1) {
        load_scales(h + NB, mv);
        for (int j = 0; j < NV; ++j) storeu(m + j * VW, mv[j]);
    }
    const uint8_t* q = rec + (KIND == Q4_1 ? 4 : 2) * NB;
    constexpr int VB = 4 * VW;  // bytes per vector
    for (int qd = 0; qd < GQ; ++qd) {
        if constexpr (KIND == Q8_0) {
            for (int j = 0; j < NV; ++j) {
                const ivec w = load_iv(q + (qd * NV + j) * VB);
#if SF_Q4_DOT == 1
                store_iv(wq + (qd * NV + j) * VB, w);
                (void)ws;
#else
                const ivec sw = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));  // w
                store_iv(wq + (qd * NV + j) * VB, _mm256_abs_epi8(sw));
                store_iv(ws + (qd * NV + j) * VB, sw);
#endif
            }
        } else {
            for (int c = 0; c < NV / 2; ++c) {
                const ivec v = load_iv(q + (qd * NV / 2 + c) * VB);
#if SF_Q4_DOT == 1
                const ivec lo = _mm512_and_si512(v, _mm512_set1_epi8(15));
                const ivec hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15));
#else
                const ivec lo = _mm256_and_si256(v, _mm256_set1_epi8(15));
                const ivec hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15));
#endif
                store_iv(wq + (qd * NV + 2 * c) * VB, lo);
                store_iv(wq + (qd * NV + 2 * c + 1) * VB, hi);
            }
        }
    }
}

// s += the 4-k dot products of weight bytes w (unsigned; Q8_0 on AVX2: |w|, with ws the signed
// weights) and the broadcast xq quad xb.
template <int KIND>
inline ivec dot4(ivec s, ivec w, const uint8_t* ws, ivec xb) {
#if SF_Q4_DOT == 1
    (void)ws;
    return _mm512_dpbusd_epi32(s, w, xb);
#else
    const ivec x = KIND == Q8_0 ? _mm256_sign_epi8(xb, load_iv(ws)) : xb;
    return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}

// Rows [0..R) of the quantized x (from row m, k0) against the pass's unpacked groups, into acc.
template <int KIND, int R>
inline void dot_strip(const QuantRows& xr, int64_t K, int64_t m, int64_t k0, int64_t groups, const uint8_t* wq,
                      const uint8_t* ws, const float* dbuf, const float* mbuf, vf (&acc)[DOT_MR][NV]) {
    constexpr int VB = 4 * VW;
    const int64_t G = K / QK;
    for (int64_t g = 0; g < groups; ++g) {
        ivec s[DOT_MR][NV];
        for (int r = 0; r < R; ++r)
            for (int j = 0; j < NV; ++j) s[r][j] = ivec{};
        const int64_t kg = k0 + g * QK;
        for (int qd = 0; qd < GQ; ++qd) {
            ivec xb[DOT_MR];
            for (int r = 0; r < R; ++r) {
                int32_t quad;
                std::memcpy(&quad, xr.q.data() + (m + r) * K + kg + 4 * qd, 4);
#if SF_Q4_DOT == 1
                xb[r] = _mm512_set1_epi32(quad);
#else
                xb[r] = _mm256_set1_epi32(quad);
#endif
            }
            const int64_t off = ((g * GQ + qd) * NV) * VB;
            for (int j = 0; j < NV; ++j) {
                const ivec w = load_iv(wq + off + j * VB);
                for (int r = 0; r < R; ++r) s[r][j] = dot4<KIND>(s[r][j], w, ws + off + j * VB, xb[r]);
            }
        }
        const int64_t gi = kg / QK;
        float xs[DOT_MR], xsum[DOT_MR];
        int32_t corr[DOT_MR];
        for (int r = 0; r < R; ++r) {
            const int64_t row = (m + r) * G + gi;
            xs[r] = xr.scale[row];
            xsum[r] = xr.sum[row];
            corr[r] = weight_offset<KIND>() * xr.qsum[row];
        }
        for (int j = 0; j < NV; ++j) {  // each scale vector loaded once for the strip's rows
            const vf dj = loadu(dbuf + g * NB + j * VW);
            for (int r = 0; r < R; ++r) {
                vi si;
                std::memcpy(&si, &s[r][j], sizeof(si));
                if constexpr (weight_offset<KIND>() != 0) si -= corr[r];
                acc[r][j] += __builtin_convertvector(si, vf) * (dj * xs[r]);
            }
            if constexpr (KIND == Q4_1) {
                const vf mj = loadu(mbuf + g * NB + j * VW);
                for (int r = 0; r < R; ++r) acc[r][j] += mj * xsum[r];
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

template <int KIND, bool GATED>
void linear_dot(const float* x, int64_t sx, const uint8_t* w, int64_t N, int64_t K, const float* bias, float* y,
                int64_t sy, int64_t M, const sf_lora::Deltas* lora = nullptr) {
    if (M <= 0 || N <= 0 || K <= 0) return;
    constexpr int64_t out_cols = GATED ? NB / 2 : NB;
    const int64_t G = K / QK, block_bytes = G * dot_record_bytes<KIND>();
    const int64_t blocks = (N + out_cols - 1) / out_cols;
    const int threads = omp_get_max_threads();
    const sf_split::Split sp = sf_split::split(M, blocks, DOT_MR, threads, M * blocks * NB * K >= 4 * kParallelMacs);
    const int64_t chunk_rows = sp.chunk_rows, items = sp.items;
    const bool par = sp.par;
    QuantRows xr;
    xr.q.resize(M * K);
    xr.scale.resize(M * G);
    xr.sum.resize(M * G);
    xr.qsum.resize(M * G);
#pragma omp parallel if (par)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; ++r)
            quantize_row(x + r * sx, K, xr.q.data() + r * K, xr.scale.data() + r * G, xr.sum.data() + r * G,
                         xr.qsum.data() + r * G);
        alignas(64) uint8_t wq[DOT_KC * NB];
        alignas(64) uint8_t ws[KIND == Q8_0 && SF_Q4_DOT == 2 ? DOT_KC * NB : 1];
        alignas(64) float dbuf[DOT_KC / QK * NB], mbuf[KIND == Q4_1 ? DOT_KC / QK * NB : 1];
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
                for (int64_t g = 0; g < groups; ++g)
                    unpack_group<KIND>(wb + (k0 / QK + g) * dot_record_bytes<KIND>(), wq + g * QK * NB,
                                       ws + (KIND == Q8_0 && SF_Q4_DOT == 2 ? g * QK * NB : 0), dbuf + g * NB,
                                       mbuf + (KIND == Q4_1 ? g * NB : 0));
                const bool first = k0 == 0, last = k0 + groups * QK >= K;
                const float* d = last && lora != nullptr
                                     ? sf_lora::block_addend<float, GATED>({lora}, N, m0, rows, n0, cols) : nullptr;
                const int64_t* row_slot = lora == nullptr ? nullptr : lora->row_slot + m0;
                const sf_ahead::Share next =
                    next_chunk(w, wb, block_bytes, dot_record_bytes<KIND>(), K, k0 + DOT_KC, DOT_KC, sp.next_block(it, M));
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

// Output columns per packed block (linear.cpp's NB) and bytes per (block, group) record by kind.
int sf_q4_block_width(void) { return NB; }
int64_t sf_q4_record_bytes(int kind) {
    return kind == Q4_0 ? record_bytes<Q4_0>() : kind == Q4_1 ? record_bytes<Q4_1>() : record_bytes<Q8_0>();
}

// Packed arguments (int64 slots): x, x row stride, packed w, N (output columns; a gated weight's
// intermediate size), K (a multiple of 32), bias (float32 in the packed column order, or 0), y,
// y row stride, M.
void sf_q4_linear_q4_0(const int64_t* a) { linear_packed<Q4_0, false>(a); }
void sf_q4_linear_q4_1(const int64_t* a) { linear_packed<Q4_1, false>(a); }
void sf_q4_linear_q8_0(const int64_t* a) { linear_packed<Q8_0, false>(a); }
void sf_q4_linear_silu_mul_q4_0(const int64_t* a) { linear_packed<Q4_0, true>(a); }
void sf_q4_linear_silu_mul_q4_1(const int64_t* a) { linear_packed<Q4_1, true>(a); }
void sf_q4_linear_silu_mul_q8_0(const int64_t* a) { linear_packed<Q8_0, true>(a); }

// The integer form: 1 AVX-512 VNNI, 2 AVX2 (vpmaddubsw), 0 absent (its entry points do nothing).
int sf_q4_dot_products(void) { return SF_Q4_DOT; }
// The same arguments, over weights packed for the integer form (quant4.py: form="dot").
#if SF_Q4_DOT
void sf_q4_dot_q4_0(const int64_t* a) { linear_dot_packed<Q4_0, false>(a); }
void sf_q4_dot_q4_1(const int64_t* a) { linear_dot_packed<Q4_1, false>(a); }
void sf_q4_dot_q8_0(const int64_t* a) { linear_dot_packed<Q8_0, false>(a); }
void sf_q4_dot_silu_mul_q4_0(const int64_t* a) { linear_dot_packed<Q4_0, true>(a); }
void sf_q4_dot_silu_mul_q4_1(const int64_t* a) { linear_dot_packed<Q4_1, true>(a); }
void sf_q4_dot_silu_mul_q8_0(const int64_t* a) { linear_dot_packed<Q8_0, true>(a); }
#else
void sf_q4_dot_q4_0(const int64_t*) {}
void sf_q4_dot_q4_1(const int64_t*) {}
void sf_q4_dot_q8_0(const int64_t*) {}
void sf_q4_dot_silu_mul_q4_0(const int64_t*) {}
void sf_q4_dot_silu_mul_q4_1(const int64_t*) {}
void sf_q4_dot_silu_mul_q8_0(const int64_t*) {}
#endif

// Any of the above by number (kind: Kind, Q4_0 / Q4_1 / Q8_0; dot: the integer form; gated:
// silu_mul), plus the rows' LoRA deltas where `lora` (an sf_lora::Deltas) is given, for
// decoder.cpp's projections.
void sf_q4_linear_any(const int64_t* a, int kind, int dot, int gated, const void* lora) {
    const auto* e = static_cast<const sf_lora::Deltas*>(lora);
    using Fn = void (*)(const int64_t*, const sf_lora::Deltas*);
    static constexpr Fn plain[2][3] = {{linear_packed<Q4_0, false>, linear_packed<Q4_1, false>, linear_packed<Q8_0, false>},
                                       {linear_packed<Q4_0, true>, linear_packed<Q4_1, true>, linear_packed<Q8_0, true>}};
#if SF_Q4_DOT
    static constexpr Fn integer[2][3] = {
        {linear_dot_packed<Q4_0, false>, linear_dot_packed<Q4_1, false>, linear_dot_packed<Q8_0, false>},
        {linear_dot_packed<Q4_0, true>, linear_dot_packed<Q4_1, true>, linear_dot_packed<Q8_0, true>}};
#else
    static constexpr Fn integer[2][3] = {};
    if (dot) return;  // no integer form in this build (the Python side never packs one for it)
#endif
    if (kind < 0 || kind > 2) return;
    (dot ? integer : plain)[gated ? 1 : 0][kind](a, e);
}

}  // extern "C"
