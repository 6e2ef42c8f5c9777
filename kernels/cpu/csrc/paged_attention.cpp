// Paged attention over a ragged batch (prompt chunks + decodes in one call) and the KV-cache
// write, for CPUs. fp32 queries and outputs, fp32 accumulation; the K/V cache in fp32 or bf16
// (bf16 values are widened to fp32 in registers as the strips load them, read in place like
// fp32: half the memory traffic of an fp32 cache, the same arithmetic). Called through ctypes from
// splitfuse/kernels/cpu/paged_attention.py, which documents the API and validates arguments.
//
// Cache layout (one flat tile per (block, kv head)):
//   k_cache, v_cache: [num_blocks][num_kv_heads][block_size * head_dim] floats (or bf16)
//   V tile: row-major [block_size][head_dim].
//   K tile: k_layout 1 (the default): transposed, [head_dim][block_size], so that Q.K^T reads a
//           16-key row of K as one (or two) vector loads and needs no horizontal reduction;
//           k_layout 0: row-major like V (kept for the layout measurement in the benchmark; the
//           kernel then transposes each 16-key tile into an L1 buffer).
//
// Work decomposition: a work item is (sequence, kv head, tile of query tokens, KV split). The
// GROUP = Hq / Hkv query heads sharing the kv head are rows of the same tile (row = token * G +
// head), so each K/V load serves all of them. The item walks its key range in tiles of 16 keys
// read in place through the block table (block_size a multiple of 16; smaller or odd block
// sizes, and bf16 with K row-major, pack the 16 keys into an L1 buffer), NT tiles (a softmax
// block of 64 keys) at a time, and the rows in register strips of MR rows. Per strip and block:
//   for each tile: S = Q.K^T (MR x 16 in registers) -> mask (causal offset, sliding window,
//   tail) -> S into an L1 scratch; then one online-softmax update in base 2 (running max m,
//   running sum l) for the block's 64 keys; then O = alpha * O + P.V over its tiles (MR x 16
//   columns of the head dim in registers, loaded and stored once per block).
// Tiles whose keys no row of a strip sees are skipped, and masks are only computed where the
// causal diagonal, the window edge or the sequence end crosses the tile.
//
// Scheduling: the threads take the batch's items from a shared counter (dynamic), largest first,
// prompt-chunk items (compute-bound) interleaved with decode items (memory-bound). The first strip
// of a block prefetches the next block's K/V tiles into L2 (software prefetch; tiles of different
// cache blocks are in different pages, where the hardware prefetchers stop); where those targets
// pass an item's end, they are the first tiles of the thread's next item (claimed then). Measured
// on a 2-core Zen 5, 16 and 32 decodes x ~600 keys of a bf16 model: 0.222 -> 0.19-0.20 ms and
// 0.454 -> 0.35-0.40 ms (1 thread: 0.374 -> 0.30-0.31 ms and 0.716 -> 0.57-0.62 ms).
// Split-KV: when the items are too few or too uneven for the threads (one long decode with
// few KV heads), the key range of the large items is cut into partitions; each writes its
// unnormalised (O, m, l) to a workspace, and a second parallel loop merges them.
//
// The vector code is GCC vector extensions (attention_simd.h): the same source is AVX-512,
// AVX2 or SSE code depending on -march; only register-blocking constants differ (MR below).
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "attention_simd.h"
#include "bf16.h"
#include "kv_int8.h"
#include "sf_api.h"

// bf16 products (vdpbf16ps: 32 bf16 products summed pairwise into 16 fp32 lanes, twice the
// multiplies of an fp32 FMA per instruction) for prompt chunks of a bf16 model over a bf16
// cache, on CPUs with AVX-512 BF16. Not under an SF_ATTN_VL override (a test build of another
// width's code path).
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && SF_ATTN_WIDTH == 16 && !defined(SF_ATTN_VL)
#define SF_ATTN_BF16_DOT 1
#include <immintrin.h>
#else
#define SF_ATTN_BF16_DOT 0
#endif

namespace sf_attn {
namespace {

// Rows per register strip (MR <= VL: a strip's per-row softmax statistics fit one vector) and
// query rows (tokens x group heads) per work item.
#if SF_ATTN_WIDTH == 16
constexpr int MR = 12;            // 12 rows x 1 zmm = 12 accumulators of 32 zmm registers
constexpr int ROWS_DEFAULT = 96;
#elif SF_ATTN_WIDTH == 8
constexpr int MR = 6;             // 6 rows x 2 ymm = 12 accumulators of 16 ymm registers
constexpr int ROWS_DEFAULT = 48;
#else
constexpr int MR = 4;             // 4 rows x 4 xmm = 16 accumulators (no AVX: correctness path)
constexpr int ROWS_DEFAULT = 32;
#endif
static_assert(MR <= VL, "a strip's row statistics must fit one vector");
// Keys per online-softmax update: a strip scores NT tiles of 16 keys, then updates its running
// max and sum and rescales O once for all of them (the per-update work, the row reductions, the
// exp of the rescale and the load, rescale and store of O, is paid once per 64 keys, not 16).
constexpr int NT = 4;
constexpr int LDS = NT * TN;  // row stride of a strip's score scratch
// Into L2, not L1 (prefetcht1): a tile is 128 lines of fp32 K/V, more than the L1's miss
// buffers hold; prefetcht0 bursts of that size made decodes latency-bound (measured on a 2-core
// AMD EPYC, 64 decodes x 600 keys from DRAM: 17 -> 25 GB/s of K/V read, near its 28 GB/s).
static inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 2); }
constexpr int MIN_SPLIT_TILES = 8;  // a KV split covers at least 8 x 16 = 128 keys

struct Ctx {
    const float* q;
    const uint16_t* q16;  // the same queries as bf16, when q_bf16
    int q_bf16;
    int64_t q_st, q_sh;
    float* out;
    int64_t o_st, o_sh;
    const float* kc;
    const float* vc;
    const uint16_t* kc16;  // the same caches as bf16, when kv_bf16
    const uint16_t* vc16;
    const int8_t* kc8;  // the same caches as int8 codes and scales (kv_int8.h), when kv_i8
    const int8_t* vc8;
    int kv_bf16, kv_i8;
    int64_t tile;  // elements (int8: bytes) of one (block, kv head) tile of the cache
    const int32_t* qsl;
    const int32_t* seq_lens;
    const int32_t* bt;
    int64_t bt_st;
    int Hq, Hkv, G, D, bs, window, k_layout;
    float scale_log2;
};

struct Item {
    int32_t b, h, t0, t1;  // sequence, kv head, query tokens [t0, t1) of the sequence
    int32_t kt0, kt1;      // key tiles [kt0, kt1) (tile i = keys 16i .. 16i + 15)
    int32_t nsplit;        // > 1: a KV partition, writes its partial result at `ws`
    int32_t pad;
    int64_t ws;
    float cost;
};

struct Group {  // the partitions of one split (sequence, kv head, token tile): items ws.. ws + nsplit * stride
    int32_t b, h, t0, t1, nsplit;
    int64_t ws;
};

// Keep a loaded vector in a register: without this GCC folds the load into every FMA that uses
// it (one load per use), and the decode kernels (few rows per load) become load-port bound.
// By value: an array element as the asm's operand would keep the whole array in memory (GCC
// does not split an aggregate an asm statement uses into registers), and every use would read it
// back from the stack.
static inline vf in_reg(vf v) {
#if (defined(__x86_64__) || defined(__i386__)) && SF_ATTN_WIDTH == 16 && defined(__AVX512F__)
    __asm__("" : "+v"(v));  // any of the 32 zmm registers ("x" would confine it to the first 16)
#elif (defined(__x86_64__) || defined(__i386__)) && (SF_ATTN_WIDTH == 4 || (SF_ATTN_WIDTH == 8 && defined(__AVX__)))
    __asm__("" : "+x"(v));  // (only when vf is one register of this ISA)
#endif
    return v;
}

// Independent accumulator sets for strips of few rows (decode): R rows x NV vectors per set plus
// the NV loaded vectors of each set must stay within the vector registers (16, or 32 with AVX-512).
constexpr int NREG = VL == 16 ? 32 : 16;
constexpr int ilp_factor(int R) { return std::max(1, std::min(4, (NREG - 1) / (NV * (R + 1)))); }

static inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
static inline size_t round16(size_t n) { return (n + 15) & ~size_t(15); }

// Grow-only 64-byte aligned per-thread scratch (the OpenMP pool threads persist across calls,
// so steady-state calls allocate nothing and touch no fresh pages).
struct Scratch {
    float* p = nullptr;
    size_t cap = 0;
    float* get(size_t n) {
        if (n > cap) {
            std::free(p);
            size_t bytes = round16(n) * sizeof(float);
            p = static_cast<float*>(std::aligned_alloc(64, bytes));
            if (!p) { cap = 0; return nullptr; }
            cap = round16(n);
        }
        return p;
    }
    ~Scratch() { std::free(p); }
};
static thread_local Scratch tls_scratch;
static thread_local Scratch tls_workspace;

// ---------------------------------------------------------------------------------------------
// Micro-kernels. T is the cache's element type: float, or uint16_t holding bf16 bits, widened to
// fp32 as it is loaded (exact: bf16 is the high half of a float), so a bf16 cache is read in
// place at half the memory traffic, with the same fp32 arithmetic.

static inline vf load_kv(const float* p) { return loadu(p); }
static inline vf load_kv(const uint16_t* p) {
#if SF_ATTN_WIDTH == 16 && defined(__AVX512F__)
    return (vf)sf_bf16::widen16(p);
#else
    typedef uint16_t vh __attribute__((vector_size(VL * 2), aligned(2), may_alias));
    return (vf)(__builtin_convertvector(*reinterpret_cast<const vh*>(p), vu) << 16);
#endif
}
static inline v8 load_kv8(const float* p) { return loadu8(p); }
static inline v8 load_kv8(const uint16_t* p) {
    typedef uint16_t h8 __attribute__((vector_size(16), aligned(2), may_alias));
    typedef uint32_t u8x __attribute__((vector_size(32)));
    return (v8)(__builtin_convertvector(*reinterpret_cast<const h8*>(p), u8x) << 16);
}
static inline float kv_to_f32(float x) { return x; }
static inline float kv_to_f32(uint16_t h) { return sf_bf16::to_f32(h); }

// S[R][16] = Q . Kt[D][16] (Kt rows ldk apart), Q packed d-major for the strip: Q[d * R + i]
// (one pointer, immediate offsets: no general register per row). Strips of few rows (decode:
// R = group size) use ilp_factor(R) accumulator sets over d, so that enough independent FMA
// chains fill both pipes.
template <int R, bool PF, typename T>
static inline void qk_strip(const float* __restrict Q, int D, const T* __restrict kt, int64_t ldk,
                            const T* pf, vf (&s)[R][NV]) {
    constexpr int U = ilp_factor(R);  // accumulator sets over d
    vf acc[U][R][NV];
    for (int u = 0; u < U; ++u)
        for (int i = 0; i < R; ++i)
            for (int c = 0; c < NV; ++c) acc[u][i][c] = vf{};
    int d = 0;
    for (; d + U <= D; d += U) {
        for (int u = 0; u < U; ++u) {
            if (PF) prefetch(pf + (d + u) * ldk);  // the same row of a later tile (64 bytes)
            vf b[NV];
            for (int c = 0; c < NV; ++c) b[c] = in_reg(load_kv(kt + (d + u) * ldk + c * VL));
            for (int i = 0; i < R; ++i) {
                const float a = Q[(d + u) * R + i];
                for (int c = 0; c < NV; ++c) acc[u][i][c] += a * b[c];
            }
        }
    }
    for (; d < D; ++d) {
        if (PF) prefetch(pf + d * ldk);
        vf b[NV];
        for (int c = 0; c < NV; ++c) b[c] = in_reg(load_kv(kt + d * ldk + c * VL));
        for (int i = 0; i < R; ++i) {
            const float a = Q[d * R + i];
            for (int c = 0; c < NV; ++c) acc[0][i][c] += a * b[c];
        }
    }
    for (int i = 0; i < R; ++i)
        for (int c = 0; c < NV; ++c) {
            vf t = acc[0][i][c];
            for (int u = 1; u < U; ++u) t += acc[u][i][c];
            s[i][c] = t;
        }
}

// The tiles of one softmax block as a strip sees them: tile t's V rows at v[t] (ldv apart), its
// keys [jlo[t], jhi[t]) unmasked for some row of the strip, its P at column t * TN of P's rows
// (ldp apart), and the next block's V tile to prefetch at pf[t] (read by the PF kernels only).
template <typename T>
struct PvTiles {
    const T* const* v;
    const T* const* pf;
    const int* jlo;
    const int* jhi;
    int n;
};

// Not inlined into the AVX-512 strips: there GCC 12 kept the loaded V vectors on the stack
// (every FMA read its operand back through a store) under the register pressure of the whole
// strip; on its own the loop keeps them in registers. The AVX2 build is faster inlined
// (measurements: perf/results/README.md, s34).
#if SF_ATTN_WIDTH == 16
#define PV_CHUNKS_INLINE __attribute__((noinline)) static
#else
#define PV_CHUNKS_INLINE static inline
#endif
// CH consecutive 16-column chunks of O[R][..] = alpha * O + sum over the tiles of P . V: O is
// loaded, rescaled and stored once per block, the accumulators stay in registers across its tiles.
template <int R, int CH, bool PF, typename T>
PV_CHUNKS_INLINE void pv_chunks(const float* __restrict P, int ldp, const PvTiles<T>& tl, int64_t ldv,
                             const float* alpha, float* __restrict O, int D, int d0) {
    vf acc[R][CH * NV];
    for (int i = 0; i < R; ++i) {
        const vf a = splat(alpha[i]);
        for (int c = 0; c < CH * NV; ++c) acc[i][c] = loadu(O + i * D + d0 + c * VL) * a;
    }
    for (int t = 0; t < tl.n; ++t) {
        const T* __restrict v = tl.v[t];
        if (PF)
            for (int j = 0; j < TN; ++j)
                for (int h = 0; h < CH; ++h) prefetch(tl.pf[t] + j * ldv + d0 + h * TN);
        const float* Pt = P + t * TN;
        for (int j = tl.jlo[t]; j < tl.jhi[t]; ++j) {
            vf b[CH * NV];
            for (int c = 0; c < CH * NV; ++c) b[c] = in_reg(load_kv(v + j * ldv + d0 + c * VL));
            for (int i = 0; i < R; ++i) {
                const float p = Pt[i * ldp + j];
                for (int c = 0; c < CH * NV; ++c) acc[i][c] += p * b[c];
            }
        }
    }
    for (int i = 0; i < R; ++i)
        for (int c = 0; c < CH * NV; ++c) storeu(O + i * D + d0 + c * VL, acc[i][c]);
}

// O[R][D] = alpha * O + P . V over the block's tiles (P rows ldp apart, tile t's at column t * TN).
// Few rows (decode) take several 16-column chunks per pass: more independent FMA chains and
// one P broadcast per chunk group.
template <int R, bool PF, typename T>
static inline void pv_strip(const float* __restrict P, int ldp, const PvTiles<T>& tl, int64_t ldv,
                            const float* alpha, float* __restrict O, int D) {
    constexpr int CH = ilp_factor(R);
    int d0 = 0;
    if (CH > 1)
        for (; d0 + CH * TN <= D; d0 += CH * TN) pv_chunks<R, CH, PF, T>(P, ldp, tl, ldv, alpha, O, D, d0);
    for (; d0 + TN <= D; d0 += TN) pv_chunks<R, 1, PF, T>(P, ldp, tl, ldv, alpha, O, D, d0);
    if (d0 + 8 <= D) {
        v8 acc[R];
        for (int i = 0; i < R; ++i) acc[i] = loadu8(O + i * D + d0) * alpha[i];
        for (int t = 0; t < tl.n; ++t)
            for (int j = tl.jlo[t]; j < tl.jhi[t]; ++j) {
                const v8 b = load_kv8(tl.v[t] + j * ldv + d0);
                for (int i = 0; i < R; ++i) acc[i] += P[i * ldp + t * TN + j] * b;
            }
        for (int i = 0; i < R; ++i) storeu8(O + i * D + d0, acc[i]);
        d0 += 8;
    }
    for (; d0 < D; ++d0) {
        for (int i = 0; i < R; ++i) {
            float acc = O[i * D + d0] * alpha[i];
            for (int t = 0; t < tl.n; ++t)
                for (int j = tl.jlo[t]; j < tl.jhi[t]; ++j)
                    acc += P[i * ldp + t * TN + j] * kv_to_f32(tl.v[t][j * ldv + d0]);
            O[i * D + d0] = acc;
        }
    }
}

#if SF_ATTN_BF16_DOT
// The bf16 product path. vdpbf16ps(acc, a, b) adds a[2i] * b[2i] + a[2i+1] * b[2i+1] to lane i:
// its operands are pairs along the summed dimension. The cache keeps its layout (K transposed,
// V row-major); two rows of 16 bf16 are interleaved into 16 pairs with one permute, shared by
// every row of the strip. Products of two bf16 are exact in fp32 and accumulate in fp32.

// (a[0], b[0], a[1], b[1], ..., a[15], b[15]) from two rows of 16 bf16.
static inline __m512i pair_rows(const uint16_t* a, const uint16_t* b) {
    alignas(64) static const uint16_t idx[32] = {0,32,1,33,2,34,3,35,4,36,5,37,6,38,7,39,8,40,9,41,10,42,11,43,12,44,13,45,14,46,15,47};
    return _mm512_permutex2var_epi16(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                                     _mm512_load_si512(idx),
                                     _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b))));
}

static inline __m512 dot_pairs(__m512 acc, __m512i a, uint32_t pair) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)_mm512_set1_epi32(int(pair)));
}

// S[R][16] = Q . Kt[D][16] with Q as bf16 pairs packed for the strip, Qp[(d / 2) * R + i] =
// (q[i][d], q[i][d + 1]) (D even). Unscaled: the caller scales S.
template <int R, bool PF>
static inline void qk_dot(const uint32_t* __restrict Qp, int D, const uint16_t* __restrict kt, int64_t ldk,
                          const uint16_t* pf, vf (&s)[R][NV]) {
    __m512 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
    for (int dp = 0; dp < D / 2; ++dp) {
        if (PF) {
            prefetch(pf + 2 * dp * ldk);
            prefetch(pf + (2 * dp + 1) * ldk);
        }
        const __m512i k = pair_rows(kt + 2 * dp * ldk, kt + (2 * dp + 1) * ldk);
        for (int i = 0; i < R; ++i) acc[i] = dot_pairs(acc[i], k, Qp[dp * R + i]);
    }
    for (int i = 0; i < R; ++i) s[i][0] = (vf)acc[i];
}

// O[R][D] = alpha * O + P . V over the block's tiles, P as bf16 pairs of keys: row i's pairs of
// tile t at Pp[i * ldp + t * TN / 2 + j / 2] = (p[i][j], p[i][j + 1]) (D a multiple of 32). A
// pair that straddles jlo or jhi takes zeros for its key outside the range (its p is 0, but its
// V row may be stale or gone: 0 * NaN).
template <int R, bool PF>
static inline void pv_dot(const uint32_t* __restrict Pp, int ldp, const PvTiles<uint16_t>& tl, int64_t ldv,
                          const float* alpha, float* __restrict O, int D) {
    constexpr int CH = 2;  // 16-column chunks per pass: R * CH accumulators + CH pairs in registers
    alignas(32) static const uint16_t zeros[CH * TN] = {};
    for (int d0 = 0; d0 < D; d0 += CH * TN) {
        __m512 acc[R][CH];
        for (int i = 0; i < R; ++i) {
            const __m512 a = _mm512_set1_ps(alpha[i]);
            for (int h = 0; h < CH; ++h) acc[i][h] = _mm512_mul_ps(_mm512_loadu_ps(O + i * D + d0 + h * TN), a);
        }
        for (int t = 0; t < tl.n; ++t) {
            const uint16_t* __restrict v = tl.v[t];
            if (PF)
                for (int j = 0; j < TN; ++j) prefetch(tl.pf[t] + j * ldv + d0);
            const int jlo = tl.jlo[t], jhi = tl.jhi[t];
            const uint32_t* Pt = Pp + t * (TN / 2);
            for (int jp = jlo / 2; jp < (jhi + 1) / 2; ++jp) {
                const uint16_t* r0 = 2 * jp >= jlo ? v + 2 * jp * ldv + d0 : zeros;
                const uint16_t* r1 = 2 * jp + 1 < jhi ? v + (2 * jp + 1) * ldv + d0 : zeros;
                __m512i b[CH];
                for (int h = 0; h < CH; ++h) b[h] = pair_rows(r0 + h * TN, r1 + h * TN);
                for (int i = 0; i < R; ++i) {
                    const uint32_t p = Pt[i * ldp + jp];
                    for (int h = 0; h < CH; ++h) acc[i][h] = dot_pairs(acc[i][h], b[h], p);
                }
            }
        }
        for (int i = 0; i < R; ++i)
            for (int h = 0; h < CH; ++h) _mm512_storeu_ps(O + i * D + d0 + h * TN, acc[i][h]);
    }
}
#endif

// One tile of 16 keys of a softmax block, as the strips read it.
struct Tile {
    const void* kt;    // K^T rows (ldk apart), float or bf16 bits (the strip kernel's T)
    const void* v;     // V rows (ldv apart)
    const void* pf_k;  // the tile NT tiles later, to prefetch (the tile itself when there is none)
    const void* pf_v;
    const float* ks;   // int8 cache read in place: the 16 keys' K and V scales
    const float* vs;
    int n0, nv;        // keys [n0, n0 + nv)
};

struct StripArgs {
    const float* Q;  // the strip's R rows of the pre-scaled query tile, packed d-major [D][R]
    int64_t ldk, ldv;
    int D, window;
    float qk_scale;  // bf16 product strips: the softmax scale (base 2) applied to S
    const int* pos;  // key position limit (= query position) of each row
    float* m;
    float* l;
    float* O;
    float* S;  // scratch [MR][LDS]: the block's scores, then its P (fp32, in place)
    float* Pb;  // scratch [MR][LDS / 2]: P as bf16 pairs (bf16 products)
    // The block's tiles that some row of the strip sees, tiles[0 .. n): tile t's keys
    // [jlo[t], jhi[t]) (relative to its n0) are unmasked for some row; need_mask[t] when not
    // all of its 16 keys are for all rows.
    const Tile* tiles;
    int n;
    int jlo[NT], jhi[NT];
    bool need_mask[NT];
};

// One register strip of R rows against one softmax block (up to NT tiles of 16 keys): scores of
// every tile into S, one online-softmax update for the block (running max m, running sum l), then
// P.V with O rescaled, accumulated and stored once for the whole block.
// The row statistics m (base 2) and l of the R rows are handled as one vector (R <= VL); m and l
// point into buffers padded by VL floats.
// DOT (bf16 cache, SF_ATTN_BF16_DOT): the products in bf16 (exact) with fp32 sums; Q arrives as
// unscaled bf16 pairs and P is rounded to bf16 for P.V (the row sums l add the rounded P, so each
// output row stays a weighted mean of V rows).
template <int R, bool PF, typename T, bool DOT>
static void attend_strip(const StripArgs& a) {
    vf rows[R];
    for (int i = 0; i < R; ++i) rows[i] = splat(-INFINITY);
    for (int t = 0; t < a.n; ++t) {
        const Tile& tile = a.tiles[t];
        const T* kt = static_cast<const T*>(tile.kt);
        const T* pf_k = static_cast<const T*>(tile.pf_k);
        vf s[R][NV];
#if SF_ATTN_BF16_DOT
        if constexpr (DOT) {
            static_assert(NV == 1 && sizeof(T) == 2, "bf16 products: one zmm per 16-key row, a bf16 cache");
            qk_dot<R, PF>(reinterpret_cast<const uint32_t*>(a.Q), a.D, kt, a.ldk, pf_k, s);  // unscaled
        } else
#endif
            qk_strip<R, PF>(a.Q, a.D, kt, a.ldk, pf_k, s);
        if constexpr (sizeof(T) == 1)  // int8 codes: the keys' scales multiply their scores
            for (int i = 0; i < R; ++i)
                for (int c = 0; c < NV; ++c) s[i][c] *= loadu(tile.ks + c * VL);
        if (a.need_mask[t]) {
            const vf ninf = splat(-INFINITY);
            const vi lane = iota_vi();
            for (int i = 0; i < R; ++i) {
                for (int c = 0; c < NV; ++c) {
                    const vi key = lane + (tile.n0 + c * VL);
                    // key < n0 + nv (past the sequence end: in-place tails hold stale data),
                    // causal, and inside the window.
                    vi ok = (key < tile.n0 + tile.nv) & (key <= a.pos[i]);
                    if (a.window > 0) ok &= (a.pos[i] - key) < a.window;
                    s[i][c] = ok ? s[i][c] : ninf;
                }
            }
        }
        for (int i = 0; i < R; ++i)
            for (int c = 0; c < NV; ++c) {
                storeu(a.S + i * LDS + t * TN + c * VL, s[i][c]);
                rows[i] = vmax(rows[i], s[i][c]);
            }
    }
    // Scores in base-2 softmax units: the fp32 path's queries are pre-scaled; the bf16 products
    // are scaled here (the scale is positive, so the row max of unscaled scores scales too), and
    // in the exponent below, one multiply-add with the max subtracted.
    const float sc = DOT ? a.qk_scale : 1.0f;
    const vf m_old = loadu(a.m);
    const vf m_new = vmax(m_old, reduce_rows<OpMax, R>(rows) * sc);
    // A row that has seen no key yet (all masked so far) keeps m = -inf; exp2(-inf - 0) = 0
    // then zeroes its P, alpha and l.
    const vf m_use = m_new == splat(-INFINITY) ? vf{} : m_new;
    const vf alpha = exp2v(m_old - m_use);
    alignas(64) float mu[VL], al[VL], mn[VL], ln[VL];
    storeu(mu, m_use);
    storeu(al, alpha);
    for (int i = 0; i < R; ++i) {
        const vf mb = splat(mu[i]);
        vf sum = vf{};
        for (int t = 0; t < a.n; ++t)
            for (int c = 0; c < NV; ++c) {
                float* sp = a.S + i * LDS + t * TN + c * VL;
#if SF_ATTN_BF16_DOT
                if constexpr (DOT) {  // row i's 16 bf16 of tile t: 8 pairs at Pb + i * LDS / 2 + t * 8
                    const vf p = exp2v_bf16(loadu(sp) * sc - mb);
                    const __m256bh ph = _mm512_cvtneps_pbh((__m512)p);
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.Pb + i * (LDS / 2) + t * (TN / 2)), (__m256i)ph);
                    sum += (vf)sf_bf16::widen16((__m256i)ph);  // the rounded P
                    continue;
                }
#endif
                const vf p = exp2v(loadu(sp) - mb);
                sum += p;
                // int8 V: the sums take P, P.V its columns times the keys' V scales.
                if constexpr (sizeof(T) == 1) storeu(sp, p * loadu(a.tiles[t].vs + c * VL));
                else storeu(sp, p);
            }
        rows[i] = sum;
    }
    const vf l_new = loadu(a.l) * alpha + reduce_rows<OpAdd, R>(rows);
    storeu(mn, m_new);
    storeu(ln, l_new);
    for (int i = 0; i < R; ++i) {
        a.m[i] = mn[i];
        a.l[i] = ln[i];
    }
    const T* vs[NT];
    const T* pfs[NT];
    for (int t = 0; t < a.n; ++t) {
        vs[t] = static_cast<const T*>(a.tiles[t].v);
        pfs[t] = PF ? static_cast<const T*>(a.tiles[t].pf_v) : nullptr;
    }
    const PvTiles<T> tl{vs, pfs, a.jlo, a.jhi, a.n};
#if SF_ATTN_BF16_DOT
    if constexpr (DOT) {
        pv_dot<R, PF>(reinterpret_cast<const uint32_t*>(a.Pb), LDS / 2, tl, a.ldv, al, a.O, a.D);
        return;
    }
#endif
    pv_strip<R, PF>(a.S, LDS, tl, a.ldv, al, a.O, a.D);
}

typedef void (*StripFn)(const StripArgs&);

// fns[PF][R - 1]: one kernel per row count 1..MR, without and with prefetch, for caches of T
// (DOT: with bf16 products).
template <typename T, bool DOT, int... Rs>
struct StripTable {
    static constexpr StripFn fns[2][sizeof...(Rs)] = {{&attend_strip<Rs, false, T, DOT>...},
                                                      {&attend_strip<Rs, true, T, DOT>...}};
};
template <typename T, bool DOT, int... Rs>
constexpr StripFn StripTable<T, DOT, Rs...>::fns[2][sizeof...(Rs)];

#if SF_ATTN_WIDTH == 16
template <typename T, bool DOT = false>
using Strips = StripTable<T, DOT, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12>;
#elif SF_ATTN_WIDTH == 8
template <typename T, bool DOT = false>
using Strips = StripTable<T, DOT, 1, 2, 3, 4, 5, 6>;
#else
template <typename T, bool DOT = false>
using Strips = StripTable<T, DOT, 1, 2, 3, 4>;
#endif

static_assert(sizeof(Strips<float>::fns[0]) / sizeof(StripFn) == MR, "one strip kernel per row count 1..MR");

// dst[d * dst_ld + j] = src[j * src_ld + d] for j < n, d < D: 8 x 8 blocks through shuffles
// (unpack / shuffle / lane permute on AVX), scalar edges. Used to transpose a row-major K tile
// into the L1 buffer (k_layout 0) and to write a run of tokens into a transposed K tile.
static void transpose_rows(const float* __restrict src, int64_t src_ld, int n, int D, float* __restrict dst,
                           int64_t dst_ld) {
    typedef int32_t v8i __attribute__((vector_size(32)));
    const int n8 = n & ~7, D8 = D & ~7;
    for (int j0 = 0; j0 < n8; j0 += 8) {
        for (int d0 = 0; d0 < D8; d0 += 8) {
            v8 r[8];
            for (int j = 0; j < 8; ++j) r[j] = loadu8(src + (j0 + j) * src_ld + d0);
            v8 t[8];
            for (int j = 0; j < 8; j += 2) {
                t[j] = __builtin_shuffle(r[j], r[j + 1], v8i{0, 8, 1, 9, 4, 12, 5, 13});
                t[j + 1] = __builtin_shuffle(r[j], r[j + 1], v8i{2, 10, 3, 11, 6, 14, 7, 15});
            }
            v8 u[8];
            for (int j = 0; j < 8; j += 4) {
                u[j] = __builtin_shuffle(t[j], t[j + 2], v8i{0, 1, 8, 9, 4, 5, 12, 13});
                u[j + 1] = __builtin_shuffle(t[j], t[j + 2], v8i{2, 3, 10, 11, 6, 7, 14, 15});
                u[j + 2] = __builtin_shuffle(t[j + 1], t[j + 3], v8i{0, 1, 8, 9, 4, 5, 12, 13});
                u[j + 3] = __builtin_shuffle(t[j + 1], t[j + 3], v8i{2, 3, 10, 11, 6, 7, 14, 15});
            }
            for (int j = 0; j < 4; ++j) {
                storeu8(dst + (d0 + j) * dst_ld + j0, __builtin_shuffle(u[j], u[j + 4], v8i{0, 1, 2, 3, 8, 9, 10, 11}));
                storeu8(dst + (d0 + j + 4) * dst_ld + j0,
                        __builtin_shuffle(u[j], u[j + 4], v8i{4, 5, 6, 7, 12, 13, 14, 15}));
            }
        }
        for (int d = D8; d < D; ++d)
            for (int j = j0; j < j0 + 8; ++j) dst[d * dst_ld + j] = src[j * src_ld + d];
    }
    for (int d = 0; d < D; ++d)
        for (int j = n8; j < n; ++j) dst[d * dst_ld + j] = src[j * src_ld + d];
}

static void bf16_to_f32_row(const uint16_t* __restrict src, float* __restrict dst, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) storeu8(dst + i, load_kv8(src + i));
    for (; i < n; ++i) dst[i] = kv_to_f32(src[i]);
}

// The keys [n0, n0 + nv) of a bf16 cache widened into the L1 tiles Kt [D][16] and Vt [16][D].
// Keys before `first` (left the window) are not read: their blocks may be gone.
static void load_bf16_tile(const Ctx& c, const int32_t* btr, int h, int n0, int nv, int first, float* Kt, float* Vt) {
    const int D = c.D, bs = c.bs;
    const int64_t tile_elems = int64_t(bs) * D;
    if (bs % TN == 0 && first <= n0) {  // the 16 keys are consecutive in one block
        const int64_t base = (int64_t(btr[n0 / bs]) * c.Hkv + h) * tile_elems;
        const int off = n0 % bs;
        for (int d = 0; d < D; ++d) {
            if (c.k_layout == 1)
                bf16_to_f32_row(c.kc16 + base + int64_t(d) * bs + off, Kt + d * TN, nv);
            else
                for (int j = 0; j < nv; ++j) Kt[d * TN + j] = kv_to_f32(c.kc16[base + int64_t(off + j) * D + d]);
        }
        bf16_to_f32_row(c.vc16 + base + int64_t(off) * D, Vt, nv * D);
        return;
    }
    for (int j = std::max(0, first - n0); j < nv; ++j) {
        const int p = n0 + j;
        const int64_t base = (int64_t(btr[p / bs]) * c.Hkv + h) * tile_elems;
        const int off = p % bs;
        for (int d = 0; d < D; ++d)
            Kt[d * TN + j] = kv_to_f32(c.k_layout == 1 ? c.kc16[base + off + int64_t(d) * bs]
                                                         : c.kc16[base + int64_t(off) * D + d]);
        bf16_to_f32_row(c.vc16 + base + int64_t(off) * D, Vt + size_t(j) * D, D);
    }
}

// The keys [n0, n0 + nv) of an int8 cache (K transposed) dequantized into the L1 tiles Kt [D][16]
// and Vt [16][D]: code times its token's scale. Keys before `first` (left the window) are not
// read: their blocks may be gone.
static void load_i8_tile(const Ctx& c, const int32_t* btr, int h, int n0, int nv, int first, float* Kt, float* Vt) {
    const int D = c.D, bs = c.bs;
    for (int j = std::max(0, first - n0); j < nv; ++j) {
        const int p = n0 + j;
        const int64_t base = (int64_t(btr[p / bs]) * c.Hkv + h) * c.tile;
        const int off = p % bs;
        const int64_t scale_at = base + int64_t(bs) * D + int64_t(off) * I8_SCALE_BYTES;
        const float ks = load_scale(c.kc8 + scale_at), vs = load_scale(c.vc8 + scale_at);
        const int8_t* k = c.kc8 + base + off;
        for (int d = 0; d < D; ++d) Kt[d * TN + j] = float(k[int64_t(d) * bs]) * ks;
        const int8_t* v = c.vc8 + base + int64_t(off) * D;
        float* vt = Vt + size_t(j) * D;
        int d = 0;
        for (; d + 8 <= D; d += 8) storeu8(vt + d, load_kv8(v + d) * vs);
        for (; d < D; ++d) vt[d] = float(v[d]) * vs;
    }
}

// Software prefetch of the K/V tile of keys [n0, n0 + 16) of kv head h (blocks a multiple of 16
// keys; int8: and its scales): tiles of different blocks sit in different pages, where the
// hardware prefetchers stop.
static inline void prefetch_tile(const Ctx& c, const int32_t* btr, int h, int n0) {
    const int D = c.D, bs = c.bs, es = c.kv_i8 ? 1 : c.kv_bf16 ? 2 : 4;
    const int64_t base = (int64_t(btr[n0 / bs]) * c.Hkv + h) * c.tile;
    const int off = n0 % bs;
    if (c.kv_i8) {
        const int64_t scale_at = base + int64_t(bs) * D + int64_t(off) * I8_SCALE_BYTES;
        prefetch(c.kc8 + scale_at);
        prefetch(c.vc8 + scale_at);
    }
    const char* k = reinterpret_cast<const char*>(c.kc) + base * es;
    const char* v = reinterpret_cast<const char*>(c.vc) + (base + int64_t(off) * D) * es;
    if (c.k_layout == 1)
        for (int d = 0; d < D; ++d) prefetch(k + (int64_t(d) * bs + off) * es);
    else
        for (int e = 0; e < TN * D * es; e += 64) prefetch(k + int64_t(off) * D * es + e);
    for (int e = 0; e < TN * D * es; e += 64) prefetch(v + e);
}

// ---------------------------------------------------------------------------------------------
// One work item.

// The batch's work items in the order the threads take them, from a shared counter. A thread
// claims its next item at the first softmax block whose prefetch targets pass the current item's
// end, so that those strips prefetch the next item's first tiles: the K/V stream runs on across
// items instead of waiting on DRAM at each item's start (a decode item is only ~10 blocks long).
struct Queue {
    const Item* items;
    const int32_t* order;
    size_t n;
    size_t* counter;
    size_t claim() const { return __atomic_fetch_add(counter, size_t(1), __ATOMIC_RELAXED); }
};

// Returns false when the thread's scratch could not be allocated (nothing written). Claims the
// thread's next item from q into *next (n: none left) unless *next already holds one.
static bool run_item(const Ctx& c, const Item& it, float* ws, const Queue& q, size_t* next) {
    const int G = c.G, D = c.D, bs = c.bs, Hkv = c.Hkv;
    const int qs = c.qsl[it.b];
    const int q_len = c.qsl[it.b + 1] - qs;
    const int ctx = c.seq_lens[it.b] - q_len;  // tokens cached before this step's
    const int R = (it.t1 - it.t0) * G;
    const int base_pos = ctx + it.t0;
    const int kv_hi = ctx + it.t1;  // keys [kv_lo, kv_hi) for the tile's tokens
    const int kv_lo = c.window > 0 ? std::max(0, base_pos - c.window + 1) : 0;
    const int64_t tile_elems = c.tile;

    const size_t nQ = round16(size_t(R) * D), nM = round16(R + VL), nS = MR * LDS, nK = round16(size_t(D) * TN);
    float* buf = tls_scratch.get(2 * nQ + 2 * nM + nS + nS / 2 + 2 * NT * nK + 64);
    if (!buf) return false;
    float* Qs = buf;
    float* O = Qs + nQ;
    float* m = O + nQ;
    float* l = m + nM;
    float* S = l + nM;
    float* Pb = S + nS;
    float* Kt = Pb + nS / 2;  // NT tiles of [D][16] (gathered or transposed K)
    float* Vt = Kt + NT * nK;  // NT tiles of [16][D] (gathered V)
    int* pos = reinterpret_cast<int*>(Vt + NT * nK);  // MR ints

    // In place: the strips read the tile where it sits in the cache (fp32, or bf16 with K
    // transposed); otherwise it is gathered (and widened) into the L1 buffers Kt, Vt.
    // Below AVX-512, a bf16 tile that more than two strips read (a prompt chunk) is widened once
    // into the L1 buffers rather than by every strip (vpmovzxwd + vpslld per load): AVX2 build
    // forced on a 2-core Zen 5, perf/kernels/bench_cpu_attention.py --bf16, bf16 cache against fp32:
    // prefill512@0 x0.79 -> x0.91, prefill512@512 x0.78 -> x0.91; decodes (one strip) stay in
    // place, x2.0.
    // An int8 tile is dequantized once for such items on every ISA: its widening (two
    // instructions per load) and the scale multiplies would otherwise repeat in every strip.
    const bool widen_once = ((SF_ATTN_WIDTH < 16 && c.kv_bf16) || c.kv_i8) && R > 2 * MR;
    const bool inplace = bs % TN == 0 && (!c.kv_bf16 || c.k_layout == 1) && !widen_once;
    // bf16 products for the query tiles of more than one token (prompt chunks) of bf16 queries
    // over a bf16 cache read in place; decodes (memory-bound) keep fp32 products.
    const bool dot = SF_ATTN_BF16_DOT && c.q_bf16 && c.kv_bf16 && inplace && D % 32 == 0 && it.t1 - it.t0 > 1;

    // Strips of near-equal size (e.g. 8 rows -> 4 + 4 rather than 6 + 2); the query rows of a
    // strip starting at row r0 with rn rows sit at Qs + r0 * D as [D][rn], pre-scaled fp32 (or,
    // with bf16 products, as [D / 2][rn] unscaled bf16 pairs).
    const int nstrips = (R + MR - 1) / MR;
    const int sbase = R / nstrips, sextra = R % nstrips;
    for (int si = 0, r0 = 0; si < nstrips; ++si) {
        const int rn = sbase + (si < sextra ? 1 : 0);
        float* dst = Qs + size_t(r0) * D;
        for (int i = 0; i < rn; ++i) {
            const int r = r0 + i, t = it.t0 + r / G, g = r % G;
            const int64_t at = int64_t(qs + t) * c.q_st + int64_t(it.h * G + g) * c.q_sh;
            if (dot) {
                const uint16_t* src = c.q16 + at;
                uint32_t* pairs = reinterpret_cast<uint32_t*>(dst);
                for (int d = 0; d < D; d += 2) pairs[(d / 2) * rn + i] = uint32_t(src[d]) | (uint32_t(src[d + 1]) << 16);
            } else if (c.q_bf16) {
                for (int d = 0; d < D; ++d) dst[d * rn + i] = sf_bf16::to_f32(c.q16[at + d]) * c.scale_log2;
            } else {
                for (int d = 0; d < D; ++d) dst[d * rn + i] = c.q[at + d] * c.scale_log2;
            }
        }
        r0 += rn;
    }
    std::memset(O, 0, sizeof(float) * size_t(R) * D);
    for (int r = 0; r < R; ++r) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    const int32_t* btr = c.bt + int64_t(it.b) * c.bt_st;
    // The element `e` of the K or V cache, in the cache's type.
    auto k_at = [&](int64_t e) -> const void* {
        return c.kv_i8 ? (const void*)(c.kc8 + e) : c.kv_bf16 ? (const void*)(c.kc16 + e) : (const void*)(c.kc + e);
    };
    auto v_at = [&](int64_t e) -> const void* {
        return c.kv_i8 ? (const void*)(c.vc8 + e) : c.kv_bf16 ? (const void*)(c.vc16 + e) : (const void*)(c.vc + e);
    };
    // The scales of keys [off, off + 16) of the tile at `base` (int8 caches).
    auto scales_at = [&](const int8_t* cache, int64_t base, int off) {
        return reinterpret_cast<const float*>(cache + base + int64_t(bs) * D + int64_t(off) * I8_SCALE_BYTES);
    };
    const StripFn(*strips)[MR] = dot                         ? Strips<uint16_t, true>::fns
                                 : inplace && c.kv_i8   ? Strips<int8_t>::fns
                                 : inplace && c.kv_bf16 ? Strips<uint16_t>::fns
                                                        : Strips<float>::fns;

    // The first block's tiles: nothing earlier prefetched them (later ones are prefetched by the
    // strips, one block ahead).
    if (inplace)
        for (int kt = it.kt0; kt < std::min(it.kt1, it.kt0 + NT); ++kt) prefetch_tile(c, btr, it.h, kt * TN);

    StripArgs sa;
    sa.D = D;
    sa.qk_scale = c.scale_log2;
    sa.window = c.window;
    sa.pos = pos;
    sa.S = S;
    sa.Pb = Pb;
    sa.ldk = inplace && c.k_layout == 1 ? bs : TN;
    sa.ldv = D;
    Tile tiles[NT];
    for (int kb = it.kt0; kb < it.kt1; kb += NT) {
        const int nt = std::min(NT, it.kt1 - kb);
        bool any_pf = false;
        // A block whose prefetch targets (NT tiles on) pass the item's end: the last, and the one
        // before it when the last is partial. Claim the next item, whose first tiles they become.
        const Item* nx = nullptr;
        if (kb + nt - 1 + NT >= it.kt1) {
            if (*next == SIZE_MAX) *next = q.claim();
            if (*next < q.n && inplace) nx = &q.items[q.order[*next]];
        }
        for (int t = 0; t < nt; ++t) {
            Tile& tile = tiles[t];
            const int n0 = (kb + t) * TN;
            const int nv = std::min(TN, kv_hi - n0);
            float* Ktt = Kt + t * nK;
            float* Vtt = Vt + t * nK;
            tile.n0 = n0;
            tile.nv = nv;
            if (inplace) {
                const int64_t base = (int64_t(btr[n0 / bs]) * Hkv + it.h) * tile_elems;
                const int off = n0 % bs;
                if (c.k_layout == 1) {
                    tile.kt = k_at(base + off);
                } else {  // fp32 only (see inplace)
                    transpose_rows(c.kc + base + int64_t(off) * D, D, nv, D, Ktt, TN);
                    tile.kt = Ktt;
                }
                tile.v = v_at(base + int64_t(off) * D);
                if (c.kv_i8) {
                    tile.ks = scales_at(c.kc8, base, off);
                    tile.vs = scales_at(c.vc8, base, off);
                }
                // The tile one block later, prefetched by the block's first strip. (k_layout 0:
                // qk reads the L1 tile with ldk 16, so its prefetch of pf_k + d * 16, d < D,
                // covers the next row-major 16 x D K tile exactly.)
                tile.pf_k = tile.kt;
                tile.pf_v = tile.v;
                // NT tiles on: in this item, or past its end the next item's tile at that distance.
                const Item* owner = &it;
                int t2 = kb + t + NT;
                if (t2 >= it.kt1) {
                    owner = nx;
                    t2 = nx ? nx->kt0 + (t2 - it.kt1) : 0;
                }
                if (owner != nullptr && t2 < owner->kt1) {
                    const int n2 = t2 * TN;
                    const int32_t* btr2 = c.bt + int64_t(owner->b) * c.bt_st;
                    const int64_t base2 = (int64_t(btr2[n2 / bs]) * Hkv + owner->h) * tile_elems;
                    tile.pf_k = k_at(base2 + (c.k_layout == 1 ? n2 % bs : int64_t(n2 % bs) * D));
                    tile.pf_v = v_at(base2 + int64_t(n2 % bs) * D);
                    if (c.kv_i8) {
                        prefetch(scales_at(c.kc8, base2, n2 % bs));
                        prefetch(scales_at(c.vc8, base2, n2 % bs));
                    }
                    any_pf = true;
                }
            } else if (c.kv_i8) {
                load_i8_tile(c, btr, it.h, n0, nv, kv_lo, Ktt, Vtt);
                tile.kt = tile.pf_k = Ktt;
                tile.v = tile.pf_v = Vtt;
            } else if (c.kv_bf16) {
                load_bf16_tile(c, btr, it.h, n0, nv, kv_lo, Ktt, Vtt);
                tile.kt = tile.pf_k = Ktt;
                tile.v = tile.pf_v = Vtt;
            } else {  // block size not a multiple of 16: gather the tile's keys into L1 buffers
                // Keys before the item's first one (window) are masked and their blocks may be gone.
                for (int j = std::max(0, kv_lo - n0); j < nv; ++j) {
                    const int p = n0 + j;
                    const int64_t base = (int64_t(btr[p / bs]) * Hkv + it.h) * tile_elems;
                    const int off = p % bs;
                    if (c.k_layout == 1) {
                        const float* ks = c.kc + base + off;
                        for (int d = 0; d < D; ++d) Ktt[d * TN + j] = ks[int64_t(d) * bs];
                    } else {
                        const float* ks = c.kc + base + int64_t(off) * D;
                        for (int d = 0; d < D; ++d) Ktt[d * TN + j] = ks[d];
                    }
                    std::memcpy(Vtt + size_t(j) * D, c.vc + base + int64_t(off) * D, sizeof(float) * D);
                }
                tile.kt = tile.pf_k = Ktt;
                tile.v = tile.pf_v = Vtt;
            }
        }
        int r0 = 0;
        for (int si = 0; si < nstrips; ++si) {
            const int rn = sbase + (si < sextra ? 1 : 0);
            const int pmin = base_pos + r0 / G, pmax = base_pos + (r0 + rn - 1) / G;
            const int r_begin = r0;
            r0 += rn;
            // The tiles some row of the strip sees are consecutive: the ones before have left
            // every row's window, the ones after are in every row's future.
            int ta = 0, tb = nt;
            while (tb > ta && tiles[tb - 1].n0 > pmax) --tb;
            while (ta < tb && c.window > 0 && pmin - (tiles[ta].n0 + tiles[ta].nv - 1) >= c.window) ++ta;
            if (ta == tb) continue;
            bool any_mask = false;
            for (int t = ta; t < tb; ++t) {
                const int n0 = tiles[t].n0, nv = tiles[t].nv;
                const bool mask = nv < TN || n0 + TN - 1 > pmin || (c.window > 0 && pmax - n0 >= c.window);
                sa.need_mask[t - ta] = mask;
                sa.jhi[t - ta] = std::min(nv, pmax - n0 + 1);
                sa.jlo[t - ta] = c.window > 0 ? std::max(0, pmin - c.window + 1 - n0) : 0;
                any_mask |= mask;
            }
            if (any_mask)
                for (int i = 0; i < rn; ++i) pos[i] = base_pos + (r_begin + i) / G;
            sa.tiles = tiles + ta;
            sa.n = tb - ta;
            sa.Q = Qs + size_t(r_begin) * D;
            sa.m = m + r_begin;
            sa.l = l + r_begin;
            sa.O = O + size_t(r_begin) * D;
            strips[any_pf][rn - 1](sa);
            any_pf = false;  // the block's first strip prefetches the next block
        }
    }

    if (it.nsplit == 1) {
        for (int r = 0; r < R; ++r) {
            const int t = it.t0 + r / G, g = r % G;
            float* dst = c.out + int64_t(qs + t) * c.o_st + int64_t(it.h * G + g) * c.o_sh;
            const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
            const float* src = O + size_t(r) * D;
            for (int d = 0; d < D; ++d) dst[d] = src[d] * inv;
        }
    } else {
        float* w = ws + it.ws;
        std::memcpy(w, O, sizeof(float) * size_t(R) * D);
        std::memcpy(w + size_t(R) * D, m, sizeof(float) * R);
        std::memcpy(w + size_t(R) * D + R, l, sizeof(float) * R);
    }
    return true;
}

static void merge_group(const Ctx& c, const Group& g, const float* ws) {
    const int G = c.G, D = c.D;
    const int qs = c.qsl[g.b];
    const int R = (g.t1 - g.t0) * G;
    const int64_t stride = int64_t(R) * D + 2 * R;
    const float* base = ws + g.ws;
    for (int r = 0; r < R; ++r) {
        float M = -INFINITY;
        for (int k = 0; k < g.nsplit; ++k) M = std::max(M, base[k * stride + int64_t(R) * D + r]);
        float L = 0.0f;
        const int t = g.t0 + r / G, hg = r % G;
        float* dst = c.out + int64_t(qs + t) * c.o_st + int64_t(g.h * G + hg) * c.o_sh;
        for (int d = 0; d < D; ++d) dst[d] = 0.0f;
        for (int k = 0; k < g.nsplit; ++k) {
            const float* part = base + k * stride;
            const float mk = part[int64_t(R) * D + r];
            const float lk = part[int64_t(R) * D + R + r];
            if (mk == -INFINITY || lk == 0.0f) continue;  // this partition saw no key of the row
            const float w = exp2s(mk - M);
            L += lk * w;
            const float* o = part + int64_t(r) * D;
            for (int d = 0; d < D; ++d) dst[d] += w * o[d];
        }
        const float inv = L > 0.0f ? 1.0f / L : 0.0f;
        for (int d = 0; d < D; ++d) dst[d] *= inv;
    }
}

}  // namespace

// Error codes (the Python wrapper turns them into ValueErrors).
enum {
    SF_ATTN_OK = 0,
    SF_ATTN_BAD_QSL = -1,         // query_start_loc not non-decreasing from 0 to T
    SF_ATTN_BAD_SEQ_LEN = -2,     // seq_lens[b] < query length of b
    SF_ATTN_BAD_TABLE = -3,       // seq_lens[b] needs more blocks than the block table row has
    SF_ATTN_BAD_BLOCK = -4,       // a block id (or a slot) outside the cache
    SF_ATTN_BAD_SHAPE = -5,       // sizes out of range
    SF_ATTN_NO_MEMORY = -6,
};

// Scatter k/v [T][Hkv][D] (row strides k_st/v_st, head strides k_sh/v_sh, last dim contiguous)
// into the caches at slot_mapping (slot = block * block_size + offset; < 0 skips the token).
// Tokens with consecutive slots in one block (a prompt chunk) are written as a run: with the
// transposed K tile each head-dim row of the run is then one contiguous store sequence rather
// than one scattered 4-byte store per token.
template <typename T>
static int write_kv(const T* k, int64_t k_st, int64_t k_sh, const T* v, int64_t v_st, int64_t v_sh, T* k_cache,
                    T* v_cache, const int64_t* slot_mapping, int num_tokens, int num_kv_heads, int head_dim,
                    int block_size, int64_t num_blocks, int k_layout, int num_threads) {
    if (num_tokens < 0 || num_kv_heads <= 0 || head_dim <= 0 || block_size <= 0) return SF_ATTN_BAD_SHAPE;
    const int64_t nslots = num_blocks * block_size;
    for (int t = 0; t < num_tokens; ++t)
        if (slot_mapping[t] >= nslots) return SF_ATTN_BAD_BLOCK;
    const int D = head_dim, bs = block_size, Hkv = num_kv_heads;
    const int64_t tile_elems = int64_t(bs) * D;

    static thread_local std::vector<int32_t> runs;  // start token of each run, then num_tokens
    runs.clear();
    for (int t = 0; t < num_tokens; ++t) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        if (!runs.empty()) {
            const int64_t prev = slot_mapping[t - 1];
            if (t > 0 && prev >= 0 && slot == prev + 1 && slot % bs != 0 && t - runs.back() < bs) continue;
        }
        runs.push_back(t);
    }
    const int nruns = int(runs.size());
    runs.push_back(num_tokens);
    const int32_t* R = runs.data();

    const int nth = num_threads > 0 ? num_threads : omp_get_max_threads();
    const bool par = nth > 1 && int64_t(num_tokens) * Hkv * D >= (1 << 16) && nruns > 1;
#pragma omp parallel for num_threads(nth) if (par) schedule(static)
    for (int r = 0; r < nruns; ++r) {
        const int t0 = R[r];
        // The run ends at the next run's start or at the first skipped token before it.
        int t1 = t0 + 1;
        while (t1 < R[r + 1] && slot_mapping[t1] >= 0) ++t1;
        const int64_t slot = slot_mapping[t0];
        const int64_t blk = slot / bs;
        const int off = int(slot % bs);
        const int n = t1 - t0;
        for (int h = 0; h < Hkv; ++h) {
            const int64_t base = (blk * Hkv + h) * tile_elems;
            const T* ks = k + t0 * k_st + h * k_sh;
            const T* vs = v + t0 * v_st + h * v_sh;
            if (k_layout == 1) {
                if constexpr (sizeof(T) == 4) {
                    transpose_rows(ks, k_st, n, D, k_cache + base + off, bs);
                } else {
                    for (int d = 0; d < D; ++d)
                        for (int i = 0; i < n; ++i) k_cache[base + int64_t(d) * bs + off + i] = ks[i * k_st + d];
                }
            } else {
                for (int i = 0; i < n; ++i)
                    std::memcpy(k_cache + base + int64_t(off + i) * D, ks + i * k_st, sizeof(T) * D);
            }
            for (int i = 0; i < n; ++i)
                std::memcpy(v_cache + base + int64_t(off + i) * D, vs + i * v_st, sizeof(T) * D);
        }
    }
    return 0;
}

}  // namespace sf_attn

using namespace sf_attn;

template <typename Tin>
static int write_i8_packed(const int64_t* p) {
    if (p[14] != 1) return SF_ATTN_BAD_SHAPE;  // K transposed only
    return write_kv_i8(reinterpret_cast<const Tin*>(p[0]), p[1], p[2], reinterpret_cast<const Tin*>(p[3]), p[4], p[5],
                       reinterpret_cast<int8_t*>(p[6]), reinterpret_cast<int8_t*>(p[7]),
                       reinterpret_cast<const int64_t*>(p[8]), int(p[9]), int(p[10]), int(p[11]), int(p[12]), p[13],
                       int(p[15]) > 0 ? int(p[15]) : omp_get_max_threads(), SF_ATTN_BAD_SHAPE, SF_ATTN_BAD_BLOCK);
}

extern "C" {



// 1 when prompt chunks of bf16 queries over a bf16 cache take bf16 products (vdpbf16ps).
int sf_attn_bf16_products() { return SF_ATTN_BF16_DOT; }

// stats (nullable, 4 int64): number of work items, number of split (sequence, head, tile)
// groups, largest split count, rows per token tile. dry_run != 0: plan only (for tests).
// kv_kind: the caches hold fp32 (0), bf16 (1: uint16) values, or int8 codes and scales (2:
// kv_int8.h, K transposed only); q_bf16 != 0: q holds bf16 (with a bf16 cache prompt chunks then
// take bf16 products where the CPU has AVX-512 BF16).
int sf_attn_paged_attention_f32(const float* q, int64_t q_st, int64_t q_sh, float* out, int64_t o_st, int64_t o_sh,
                                const float* k_cache, const float* v_cache, const int32_t* query_start_loc,
                                const int32_t* seq_lens, const int32_t* block_tables, int64_t bt_stride, int64_t max_blocks,
                                int num_seqs, int num_tokens, int num_heads, int num_kv_heads, int head_dim,
                                int block_size, int64_t num_blocks, float scale, int window, int k_layout,
                                int num_splits, int rows_target, int num_threads, int64_t* stats, int dry_run,
                                int kv_kind, int q_bf16) {
    if (num_seqs < 0 || num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 || head_dim > 256 ||
        block_size <= 0 || bt_stride < 0 || window < 0 || kv_kind < 0 || kv_kind > 2 || (kv_kind == 2 && k_layout != 1))
        return SF_ATTN_BAD_SHAPE;
    Ctx c;
    c.q = q;
    c.q16 = reinterpret_cast<const uint16_t*>(q);
    c.q_bf16 = q_bf16;
    c.q_st = q_st;
    c.q_sh = q_sh;
    c.out = out;
    c.o_st = o_st;
    c.o_sh = o_sh;
    c.kc = k_cache;
    c.vc = v_cache;
    c.kc16 = reinterpret_cast<const uint16_t*>(k_cache);
    c.vc16 = reinterpret_cast<const uint16_t*>(v_cache);
    c.kc8 = reinterpret_cast<const int8_t*>(k_cache);
    c.vc8 = reinterpret_cast<const int8_t*>(v_cache);
    c.kv_bf16 = kv_kind == 1;
    c.kv_i8 = kv_kind == 2;
    c.tile = c.kv_i8 ? i8_tile_bytes(block_size, head_dim) : int64_t(block_size) * head_dim;
    c.qsl = query_start_loc;
    c.seq_lens = seq_lens;
    c.bt = block_tables;
    c.bt_st = bt_stride;
    c.Hq = num_heads;
    c.Hkv = num_kv_heads;
    c.G = num_heads / num_kv_heads;
    c.D = head_dim;
    c.bs = block_size;
    c.window = window;
    c.k_layout = k_layout;
    c.scale_log2 = scale * 1.4426950408889634f;

    const int nth = num_threads > 0 ? num_threads : omp_get_max_threads();
    const int G = c.G;
    if (rows_target <= 0) rows_target = ROWS_DEFAULT;
    const int tile_tokens = std::max(1, rows_target / G);

    // Validate the batch description and build the work items.
    if (query_start_loc[0] != 0 || query_start_loc[num_seqs] != num_tokens) return SF_ATTN_BAD_QSL;
    // Plan buffers of the calling thread, reused across calls (no allocation in steady state).
    static thread_local std::vector<Item> items, work;
    static thread_local std::vector<Group> groups;
    static thread_local std::vector<int32_t> order;
    static thread_local std::vector<uint8_t> key;
    items.clear();
    work.clear();
    groups.clear();
    double total = 0.0;
    for (int b = 0; b < num_seqs; ++b) {
        const int q_len = query_start_loc[b + 1] - query_start_loc[b];
        if (q_len < 0) return SF_ATTN_BAD_QSL;
        if (q_len == 0) continue;
        const int seq_len = seq_lens[b];
        if (seq_len < q_len) return SF_ATTN_BAD_SEQ_LEN;
        if (cdiv(seq_len, block_size) > max_blocks) return SF_ATTN_BAD_TABLE;
        const int ctx = seq_len - q_len;
        const int first_key = window > 0 ? std::max(0, ctx - window + 1) : 0;
        const int32_t* btr = block_tables + int64_t(b) * bt_stride;
        for (int64_t i = first_key / block_size, e = cdiv(seq_len, block_size); i < e; ++i)
            if (btr[i] < 0 || btr[i] >= num_blocks) return SF_ATTN_BAD_BLOCK;
        for (int t0 = 0; t0 < q_len; t0 += tile_tokens) {
            const int t1 = std::min(q_len, t0 + tile_tokens);
            const int kv_hi = ctx + t1;
            const int kv_lo = window > 0 ? std::max(0, ctx + t0 - window + 1) : 0;
            Item it;
            it.b = b;
            it.t0 = t0;
            it.t1 = t1;
            it.kt0 = kv_lo / TN;
            it.kt1 = int32_t(cdiv(kv_hi, TN));
            it.nsplit = 1;
            it.pad = 0;
            it.ws = -1;
            // Causal tiles see ~half of their diagonal part; rows + 16 weighs the streaming cost
            // of few-row (decode) items.
            it.cost = float(double((t1 - t0) * G + 16) * (kv_hi - kv_lo - (t1 - t0) / 2.0));
            for (int h = 0; h < num_kv_heads; ++h) {
                it.h = h;
                items.push_back(it);
                total += it.cost;
            }
        }
    }

    // KV splits: items bigger than a share of the work the threads can balance are partitioned.
    int64_t ws_size = 0;
    int max_split = 1;
    const double target = total / (2.0 * nth);
    for (const Item& it : items) {
        const int ntiles = it.kt1 - it.kt0;
        int s = 1;
        if (num_splits > 0)  // forced (tests, tuning): down to one tile per partition
            s = std::min(num_splits, ntiles);
        else if (nth > 1 && it.cost > target)
            s = std::min(int(std::ceil(it.cost / target)), ntiles / MIN_SPLIT_TILES);
        s = std::max(1, s);
        if (s == 1) {
            work.push_back(it);
            continue;
        }
        max_split = std::max(max_split, s);
        const int R = (it.t1 - it.t0) * G;
        const int64_t stride = int64_t(R) * head_dim + 2 * R;
        Group g{it.b, it.h, it.t0, it.t1, s, ws_size};
        groups.push_back(g);
        for (int k = 0; k < s; ++k) {
            Item p = it;
            p.kt0 = it.kt0 + int32_t(int64_t(ntiles) * k / s);
            p.kt1 = it.kt0 + int32_t(int64_t(ntiles) * (k + 1) / s);
            p.nsplit = s;
            p.ws = ws_size;
            p.cost = it.cost / s;
            ws_size += stride;
            work.push_back(p);
        }
    }
    if (stats) {
        stats[0] = int64_t(work.size());
        stats[1] = int64_t(groups.size());
        stats[2] = max_split;
        stats[3] = int64_t(tile_tokens) * G;
    }
    if (dry_run || work.empty()) return SF_ATTN_OK;

    // Largest items first (dynamic scheduling then balances the tail): an O(n) bucket order by
    // the cost's binary exponent, stable within a bucket. (Measured on the mixed batch of the
    // benchmark, the interleave below: 2.6 -> 2.4 ms.)
    const size_t n = work.size();
    order.resize(n);
    {
        int cnt[64] = {0};
        key.resize(n);
        for (size_t i = 0; i < n; ++i) {
            int e;
            std::frexp(std::max(work[i].cost, 1.0f), &e);
            key[i] = uint8_t(63 - std::min(std::max(e, 0), 63));
            ++cnt[key[i]];
        }
        int acc = 0;
        for (int i = 0; i < 64; ++i) {
            const int t = cnt[i];
            cnt[i] = acc;
            acc += t;
        }
        for (size_t i = 0; i < n; ++i) order[cnt[key[i]]++] = int32_t(i);
    }
    // Interleave compute-bound items (several strips: prompt chunks) with memory-bound ones
    // (one strip: decodes), each list still largest first, so that the threads stream K/V
    // of decodes while others compute.
    {
        static thread_local std::vector<int32_t> a, b;
        a.clear();
        b.clear();
        for (size_t i = 0; i < n; ++i) {
            const Item& it = work[order[i]];
            ((it.t1 - it.t0) * G > MR ? a : b).push_back(order[i]);
        }
        if (!a.empty() && !b.empty()) {
            size_t ia = 0, ib = 0, o = 0;
            const double ratio = double(b.size()) / double(a.size());
            while (ia < a.size() || ib < b.size()) {
                if (ia < a.size() && (ib >= b.size() || double(ib) >= double(ia) * ratio)) order[o++] = a[ia++];
                else order[o++] = b[ib++];
            }
        }
    }

    float* ws = nullptr;
    if (ws_size > 0) {
        ws = tls_workspace.get(size_t(ws_size));
        if (!ws) return SF_ATTN_NO_MEMORY;
    }
    const int ngroups = int(groups.size());
    const int team = int(std::min<size_t>(size_t(nth), n));
    // Plain pointers: inside the parallel region the thread_local names would mean the workers' own.
    const Item* const W = work.data();
    const int32_t* const ord = order.data();
    const Group* const grp = groups.data();
    int failed = 0;
    size_t counter = 0;
    const Queue queue{W, ord, n, &counter};
#pragma omp parallel num_threads(team) if (team > 1)
    {
        for (size_t i = queue.claim(); i < n;) {
            size_t next = SIZE_MAX;
            if (!run_item(c, W[ord[i]], ws, queue, &next)) __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
            i = next == SIZE_MAX ? queue.claim() : next;
        }
#pragma omp barrier
        if (ngroups > 0 && !__atomic_load_n(&failed, __ATOMIC_RELAXED)) {
#pragma omp for schedule(dynamic, 1)
            for (int gi = 0; gi < ngroups; ++gi) merge_group(c, grp[gi], ws);
        }
    }
    return failed ? SF_ATTN_NO_MEMORY : SF_ATTN_OK;
}

int sf_attn_write_kv_f32(const float* k, int64_t k_st, int64_t k_sh, const float* v, int64_t v_st, int64_t v_sh,
                         float* k_cache, float* v_cache, const int64_t* slot_mapping, int num_tokens, int num_kv_heads,
                         int head_dim, int block_size, int64_t num_blocks, int k_layout, int num_threads) {
    return write_kv(k, k_st, k_sh, v, v_st, v_sh, k_cache, v_cache, slot_mapping, num_tokens, num_kv_heads, head_dim,
                    block_size, num_blocks, k_layout, num_threads);
}

// Packed-argument entry points, what the ctypes wrapper calls: ctypes converts each argument
// separately (~0.1-0.2 us apiece), so one preallocated int64 array filled by a slice assignment
// costs a third of passing 28 arguments. Layouts (pointers as integers), in order:
//   attention: q, q_st, q_sh, out, o_st, o_sh, k_cache, v_cache, query_start_loc, seq_lens,
//              block_tables, bt_stride, max_blocks, num_seqs, num_tokens, num_heads, num_kv_heads,
//              head_dim, block_size, num_blocks, window, k_layout, num_splits, rows_target,
//              num_threads, stats, dry_run, kv_kind, q_bf16                            (29)
//   write:     k, k_st, k_sh, v, v_st, v_sh, k_cache, v_cache, slot_mapping, num_tokens,
//              num_kv_heads, head_dim, block_size, num_blocks, k_layout, num_threads    (16)
//              (the same for the bf16 write, with uint16 k, v and caches, and for the int8
//              writes, with int8 caches, fp32 or bf16 k and v, k_layout 1)
int sf_attn_write_kv_bf16(const uint16_t* k, int64_t k_st, int64_t k_sh, const uint16_t* v, int64_t v_st,
                          int64_t v_sh, uint16_t* k_cache, uint16_t* v_cache, const int64_t* slot_mapping,
                          int num_tokens, int num_kv_heads, int head_dim, int block_size, int64_t num_blocks,
                          int k_layout, int num_threads) {
    return write_kv(k, k_st, k_sh, v, v_st, v_sh, k_cache, v_cache, slot_mapping, num_tokens, num_kv_heads, head_dim,
                    block_size, num_blocks, k_layout, num_threads);
}

int sf_attn_paged_attention_f32_packed(const int64_t* p, float scale) {
    return sf_attn_paged_attention_f32(
        reinterpret_cast<const float*>(p[0]), p[1], p[2], reinterpret_cast<float*>(p[3]), p[4], p[5],
        reinterpret_cast<const float*>(p[6]), reinterpret_cast<const float*>(p[7]),
        reinterpret_cast<const int32_t*>(p[8]), reinterpret_cast<const int32_t*>(p[9]),
        reinterpret_cast<const int32_t*>(p[10]), p[11], p[12], int(p[13]), int(p[14]), int(p[15]), int(p[16]),
        int(p[17]), int(p[18]), p[19], scale, int(p[20]), int(p[21]), int(p[22]), int(p[23]), int(p[24]),
        reinterpret_cast<int64_t*>(p[25]), int(p[26]), int(p[27]), int(p[28]));
}

int sf_attn_write_kv_bf16_packed(const int64_t* p) {
    return sf_attn_write_kv_bf16(reinterpret_cast<const uint16_t*>(p[0]), p[1], p[2],
                                 reinterpret_cast<const uint16_t*>(p[3]), p[4], p[5], reinterpret_cast<uint16_t*>(p[6]),
                                 reinterpret_cast<uint16_t*>(p[7]), reinterpret_cast<const int64_t*>(p[8]), int(p[9]),
                                 int(p[10]), int(p[11]), int(p[12]), p[13], int(p[14]), int(p[15]));
}

int sf_attn_write_kv_f32_packed(const int64_t* p) {
    return sf_attn_write_kv_f32(reinterpret_cast<const float*>(p[0]), p[1], p[2], reinterpret_cast<const float*>(p[3]),
                                p[4], p[5], reinterpret_cast<float*>(p[6]), reinterpret_cast<float*>(p[7]),
                                reinterpret_cast<const int64_t*>(p[8]), int(p[9]), int(p[10]), int(p[11]), int(p[12]),
                                p[13], int(p[14]), int(p[15]));
}

int sf_attn_write_kv_i8_f32_packed(const int64_t* p) { return write_i8_packed<float>(p); }
int sf_attn_write_kv_i8_bf16_packed(const int64_t* p) { return write_i8_packed<uint16_t>(p); }

}  // extern "C"
