// The decoder layers of a dense Llama-family model, run one after another from one call: the
// same kernels the Python layers call one by one (rms_norm and rotary from elementwise.cpp, the
// linear kernel of linear.cpp, the KV write and paged attention of paged_attention.cpp), with
// the same arguments, so the results are bit-identical to the Python path's. What it saves is
// the Python between the kernels: ~10 calls per layer, each a few microseconds of wrapper
// checks and argument packing and a GIL re-acquisition (which a server's response threads can
// delay). Python wrapper and conditions: splitfuse/kernels/cpu/decoder.py.
//
// One layer, H hidden, N = (Hq + 2 Hkv) * D, I intermediate, all [T, .] row-major, fp32 or bf16:
//   layer 0:  Y = norm_in(X); the residual stream is X itself (written in place from here on)
//   layer l:  RES = Y + RES; Y = norm_in(RES)
//   QKV = Y . Wqkv^T (+ b); rotate q, k in place; write k, v into the caches
//   ATT = attention(q) (fp32; rounded to bf16 for a bf16 model, as torch's .to() rounds)
//   AO = ATT . Wo^T (+ b); RES = AO + RES; AO = norm_post(RES)
//   ACT = silu(AO . Wgate^T) * (AO . Wup^T); Y = ACT . Wdown^T (+ b)
// The hidden state after the last layer run is Y, the residual stream RES (= X). A projection
// may be int8 (quantization=int8): its input rows are quantized first, as CpuInt8Linear does;
// or GGUF blocks (quantization=gguf / gguf-exact, float32 models): quant4.cpp's kernel.
// A gate_up weight that is not gated (LoRA on gate/up where the Python layers' kernel cannot take
// their deltas before SwiGLU: int8, GGUF blocks) is projected into GU [T, 2I] and then
// ACT = silu_and_mul(GU).
//
// LoRA (optional; the deltas splitfuse/lora/batching.py's add_stacked computes): before each
// adapted projection P = IN . W^T, XA = IN . A: for steps of at most kLoraStackedMaxRows rows
// (decodes) one product with every resident slot's A side by side (A_all [in, C], at the linear
// kernel's speed), for larger ones (prompt chunks beside decodes) each row through its own slot's
// columns only (lora_shrink: 4 adapters of rank 16 on the bench model cost ~9% of the base's
// multiply-adds per row over every slot's columns, ~2% over its own). The base product then adds
// each row's XA[t, its slot's columns of part j] . B_j[its slot's rows] to its sums as it stores
// them (linear.cpp with lora_simd.h: each block's deltas computed first, on the same thread).
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "elementwise_simd.h"
#include "lora_simd.h"
#include "sf_api.h"

#if defined(__AVX512BF16__) && SF_EW_VW == 16 && SF_EW_NATIVE_VW == 16
#include <immintrin.h>
#endif


namespace {

// Per-layer table row (int64 slots): the four projections, P_FIELDS slots each (below), the
// norms' weights, the caches and the layer's attention window (0: none, else already clamped
// as the Python wrapper clamps it).
enum Layer { L_QKV = 0, L_O = 5, L_GATE_UP = 10, L_DOWN = 15, L_NORM_IN = 20, L_NORM_POST, L_K_CACHE, L_V_CACHE,
             L_WINDOW, L_GATED, L_FIELDS };
// A projection: 0 for a float weight (linear.cpp's blocks in the model's dtype), 1 for int8
// (its quads, with per-column weight sums and scales) or 2 for GGUF blocks (quant4.cpp; float32
// models), the packed data, the float32 bias in the packed column order (0: none), and for int8
// the column sums and scales, for GGUF blocks their kind (quant4.cpp's Kind) and 1 for the
// integer form; 3 for GGUF parts of different kinds (quant_parts.py), whose data is a table:
// the part count, then per part its packed data, bias, kind, integer form, first output column
// and column count (no LoRA: the Python side gives none to GGUF projections).
enum Projection { P_KIND, P_DATA, P_BIAS, P_COL_SUMS, P_SCALES, P_FIELDS };
enum { P_Q4_KIND = P_COL_SUMS, P_Q4_DOT = P_SCALES };
enum { KIND_FLOAT = 0, KIND_INT8 = 1, KIND_GGUF = 2, KIND_GGUF_PARTS = 3 };
enum { GP_DATA, GP_BIAS, GP_KIND, GP_DOT, GP_START, GP_COLS, GP_FIELDS };
static_assert(L_O - L_QKV == P_FIELDS && L_NORM_IN - L_DOWN == P_FIELDS, "projection slots");
// The model's shape: layers in the table, hidden, heads, kv heads, head dim, intermediate size,
// block size, cache blocks, model dtype bf16 (0/1), K layout of the caches, eps and the
// attention scale (doubles stored in int64 slots), the int8 projections' activation
// quantization (levels around a zero point), and the caches' kind (paged_attention.cpp's
// kv_kind: the model's dtype, or 2 for int8 codes and scales).
enum Shape { S_LAYERS, S_H, S_HQ, S_HKV, S_D, S_I, S_BLOCK, S_NUM_BLOCKS, S_BF16, S_K_LAYOUT, S_EPS, S_SCALE,
             S_LEVELS, S_ZERO_POINT, S_KV_KIND, S_FIELDS };
enum { KV_INT8 = 2 };
// One call: tokens, layers to run [0, n), X (the embedding output; becomes the residual
// stream), Y, positions (int64), cos, cos row stride, sin, sin row stride, table rows, slot
// mapping (int64), query_start_loc, seq_lens, block_tables (int32), its row stride and width,
// sequences, threads, and the scratch buffers QKV [T, N], ATT (fp32 [T, Hq*D]), ATTC (bf16
// [T, Hq*D], bf16 models), AO [T, H], ACT [T, I], and for int8 projections XQ (uint8 [T, the
// largest K]) and XS (fp32 [T]).
// Then the LoRA table (0: none; LORA_FIELDS slots per layer, below), the rows' slots (int64 [T]),
// the scratch XA [T, the widest C], the slots in the stacks, and GU [T, 2I] for a gate_up that
// is not gated.
enum Call {
    C_T, C_LAYERS, C_X, C_Y, C_POS, C_COS, C_COS_ST, C_SIN, C_SIN_ST, C_MAX_POS, C_SLOTS, C_QSL, C_SEQ_LENS,
    C_BT, C_BT_ST, C_BT_W, C_SEQS, C_THREADS, C_QKV, C_ATT, C_ATTC, C_AO, C_ACT, C_XQ, C_XS, C_LORA, C_ROW_SLOT,
    C_XA, C_LORA_SLOTS, C_GU, C_FIELDS
};
// One projection's LoRA: A_all packed (0: not adapted), its columns C, the number of parts, then
// per part its B packed, its first column in XA, its columns (B's K: every slot's R_j,
// slot-major), R_j, its first output column in P and output columns.
enum LoraProjection { LP_A, LP_COLS, LP_PARTS, LP_PART0, LP_MAX_PARTS = 3 };
enum LoraPart { LQ_B, LQ_COL, LQ_WIDTH, LQ_RANK, LQ_OUT, LQ_OUT_WIDTH, LQ_FIELDS };
enum { LP_FIELDS = LP_PART0 + LP_MAX_PARTS * LQ_FIELDS, LORA_FIELDS = 4 * LP_FIELDS };

enum { SF_DEC_BAD_POSITION = -100, SF_DEC_BAD_SHAPE = -101, SF_DEC_BAD_LORA_SLOT = -102 };

inline double slot_double(int64_t v) {
    double d;
    std::memcpy(&d, &v, sizeof(d));
    return d;
}

// dst = src rounded to bf16 (to nearest even, as torch's .to(bfloat16)); split over the pool
// from the size where torch's copy splits it too.
void to_bf16(const float* src, uint16_t* dst, int64_t n) {
    constexpr int64_t kChunk = 4096;
    const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (n >= 32768 && omp_get_max_threads() > 1)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t end = c * kChunk + kChunk < n ? c * kChunk + kChunk : n;
        for (int64_t i = c * kChunk; i < end; ++i) dst[i] = sf_bf16::from_f32(src[i]);
    }
}

template <typename T>
struct Kernels;
template <>
struct Kernels<float> {
    static constexpr auto linear = sf_lin_linear_f32_packed;
    static constexpr auto linear_gated = sf_lin_linear_silu_mul_f32_packed;
    static constexpr auto linear_i8 = sf_lin_linear_i8_f32_packed;
    static constexpr auto linear_i8_gated = sf_lin_linear_i8_silu_mul_f32_packed;
    static constexpr auto quantize = sf_ew_quantize_rows_u8_packed;
    static constexpr auto rms = sf_ew_rms_norm_f32_packed;
    static constexpr auto rotary = sf_ew_rotary_f32_packed;
    static constexpr auto write = sf_attn_write_kv_f32_packed;
    static constexpr auto silu_mul = sf_ew_silu_and_mul_f32_packed;
};
template <>
struct Kernels<uint16_t> {
    static constexpr auto linear = sf_lin_linear_bf16_packed;
    static constexpr auto linear_gated = sf_lin_linear_silu_mul_bf16_packed;
    static constexpr auto linear_i8 = sf_lin_linear_i8_bf16_packed;
    static constexpr auto linear_i8_gated = sf_lin_linear_i8_silu_mul_bf16_packed;
    static constexpr auto quantize = sf_ew_quantize_rows_u8_bf16_packed;
    static constexpr auto rms = sf_ew_rms_norm_bf16_packed;
    static constexpr auto rotary = sf_ew_rotary_bf16_packed;
    static constexpr auto write = sf_attn_write_kv_bf16_packed;
    static constexpr auto silu_mul = sf_ew_silu_and_mul_bf16_packed;
};

// y [m, n] (row stride sy) = x [m, k] (row stride sx) times projection p (gated: SwiGLU's
// silu(gate) * up, n = I), plus the rows' LoRA deltas where `lora` is given (before SwiGLU); an
// int8 projection first quantizes x's rows into XQ / XS, as CpuInt8Linear does; GGUF blocks go
// through quant4.cpp's kernel, as CpuQ4Linear does.
template <typename T>
void project(const int64_t* p, bool gated, int64_t x, int64_t sx, int64_t n, int64_t k, int64_t y, int64_t sy,
             int64_t m, const int64_t* shape, const int64_t* call, const sf_lora::Deltas* lora = nullptr) {
    using K = Kernels<T>;
    constexpr int bf16 = sizeof(T) == 2;
    if (p[P_KIND] == KIND_GGUF) {  // float32 models (the Python wrapper checks)
        const int64_t r[] = {x, sx, p[P_DATA], n, k, p[P_BIAS], y, sy, m};
        sf_q4_linear_any(r, static_cast<int>(p[P_Q4_KIND]), static_cast<int>(p[P_Q4_DOT]), gated, lora);
        return;
    }
    if (p[P_KIND] == KIND_GGUF_PARTS) {  // ungated, float32 models
        const int64_t* t = reinterpret_cast<const int64_t*>(p[P_DATA]);
        for (int64_t i = 0; i < t[0]; ++i) {
            const int64_t* q = t + 1 + i * GP_FIELDS;
            const int64_t r[] = {x, sx, q[GP_DATA], q[GP_COLS], k, q[GP_BIAS], y + q[GP_START] * 4, sy, m};
            sf_q4_linear_any(r, static_cast<int>(q[GP_KIND]), static_cast<int>(q[GP_DOT]), 0, nullptr);
        }
        return;
    }
    if (p[P_KIND] == KIND_FLOAT) {
        const int64_t r[] = {x, sx, p[P_DATA], n, k, p[P_BIAS], y, sy, m};
        if (lora != nullptr)
            sf_lin_linear_lora_packed(r, bf16, gated, 0, lora);
        else
            (gated ? K::linear_gated : K::linear)(r);
        return;
    }
    const int64_t q[] = {x, sx, call[C_XQ], call[C_XS], m, k, shape[S_LEVELS], shape[S_ZERO_POINT]};
    K::quantize(q);
    const int64_t r[] = {call[C_XQ], k, call[C_XS], shape[S_ZERO_POINT], p[P_DATA], p[P_COL_SUMS], p[P_SCALES],
                         p[P_BIAS], n, k, y, sy, m};
    if (lora != nullptr)
        sf_lin_linear_lora_packed(r, bf16, gated, 1, lora);
    else
        (gated ? K::linear_i8_gated : K::linear_i8)(r);
}

using sf_ew::vf;
using sf_ew::VW;

// The step's rows with an adapter, grouped by slot (stable): order[seg[s] .. seg[s + 1]) are
// slot s's rows.
struct SlotRows {
    std::vector<int64_t> order, seg;
};

// false when a row's slot is outside [-1, slots).
bool group_rows(const int64_t* row_slot, int64_t T, int64_t slots, SlotRows& g) {
    g.seg.assign(slots + 1, 0);
    for (int64_t t = 0; t < T; ++t) {
        if (row_slot[t] < -1 || row_slot[t] >= slots) return false;
        if (row_slot[t] >= 0) ++g.seg[row_slot[t] + 1];
    }
    for (int64_t s = 0; s < slots; ++s) g.seg[s + 1] += g.seg[s];
    g.order.resize(g.seg[slots]);
    std::vector<int64_t> at(g.seg.begin(), g.seg.end() - 1);
    for (int64_t t = 0; t < T; ++t)
        if (row_slot[t] >= 0) g.order[at[row_slot[t]]++] = t;
    return true;
}

using sf_lora::LMR;
using sf_lora::LNV;
using sf_lora::packed_vector;
using sf_lora::strip_rows;
// Steps of at most this many rows compute XA over every resident slot's columns (one product at
// the linear kernel's speed); larger ones each row's own slot's only (lora_shrink).
constexpr int64_t kLoraStackedMaxRows = 64;
// Rows of one slot per work item (whole strips), so that a long prompt chunk's rows spread over
// the threads; and the multiply-adds below which lora_shrink stays on the calling thread.
constexpr int64_t kLoraChunk = 4 * LMR;
constexpr int64_t kLoraParallelMacs = 1 << 15;

// Runs fn(item) over the items on the pool (dynamic: one slot's rows may be most of the work).
template <typename Item, typename Fn>
void for_each_lora_item(const std::vector<Item>& items, int64_t macs, Fn&& fn) {
    const int64_t n = static_cast<int64_t>(items.size());
#pragma omp parallel for schedule(dynamic) if (n > 1 && macs >= kLoraParallelMacs && omp_get_max_threads() > 1)
    for (int64_t i = 0; i < n; ++i) fn(items[i]);
}

// XA[rows of s, s's columns of every part] = X[rows of s] . A_all[:, those columns]: each row
// through its own slot's columns only, not every resident slot's (the linear kernel's deltas read no other).
// Whole vectors are multiplied (a rank below the vector width spans a neighbour slot's columns
// too) and only the slot's own columns stored.
template <typename T>
void lora_shrink(const int64_t* lp, const T* x, int64_t sx, int64_t K, T* xa, const SlotRows& g, int64_t nb) {
    const int64_t C = lp[LP_COLS], parts = lp[LP_PARTS];
    const T* a = reinterpret_cast<const T*>(lp[LP_A]);
    struct Vector {
        int64_t col, c0, c1;  // its first column; the slot's columns [c0, c1) of its part
    };
    struct Item {
        int64_t r0, r1;
        int v;
        Vector vec[LNV];  // up to LNV vectors, of any parts: one strip multiplies them together
    };
    std::vector<Item> items;
    int64_t macs = 0;
    for (int64_t s = 0; s + 1 < static_cast<int64_t>(g.seg.size()); ++s) {
        if (g.seg[s + 1] == g.seg[s]) continue;
        std::vector<Vector> vectors;
        for (int64_t j = 0; j < parts; ++j) {
            const int64_t* q = lp + LP_PART0 + j * LQ_FIELDS;
            const int64_t c0 = q[LQ_COL] + s * q[LQ_RANK], c1 = c0 + q[LQ_RANK];
            for (int64_t col = c0 / VW * VW; col < c1; col += VW) vectors.push_back({col, c0, c1});
            macs += (g.seg[s + 1] - g.seg[s]) * q[LQ_RANK] * K;
        }
        for (size_t v0 = 0; v0 < vectors.size(); v0 += LNV)
            for (int64_t r0 = g.seg[s]; r0 < g.seg[s + 1]; r0 += kLoraChunk) {
                Item item{r0, r0 + kLoraChunk < g.seg[s + 1] ? r0 + kLoraChunk : g.seg[s + 1], 0, {}};
                for (size_t i = v0; i < vectors.size() && item.v < LNV; ++i) item.vec[item.v++] = vectors[i];
                items.push_back(item);
            }
    }
    for_each_lora_item(items, macs, [&](const Item& item) {
        const T* w[LNV];
        for (int j = 0; j < item.v; ++j) w[j] = packed_vector(a, K, nb, item.vec[j].col);
        for (int64_t i = item.r0; i < item.r1; i += LMR) {
            const int rows = static_cast<int>(item.r1 - i < LMR ? item.r1 - i : LMR);
            const T* xr[LMR];
            for (int r = 0; r < rows; ++r) xr[r] = x + g.order[i + r] * sx;
            vf acc[LMR][LNV];
            strip_rows<T>(rows, item.v, xr, w, nb, 0, K, acc);
            for (int r = 0; r < rows; ++r) {
                T* out = xa + g.order[i + r] * C;
                for (int j = 0; j < item.v; ++j) {
                    const Vector& vec = item.vec[j];
                    if (vec.col >= vec.c0 && vec.col + VW <= vec.c1) {
                        sf_ew::storeu(out + vec.col, acc[r][j]);
                    } else {
                        float tmp[VW];
                        sf_ew::storeu(tmp, acc[r][j]);
                        for (int64_t c = vec.col < vec.c0 ? vec.c0 : vec.col; c < vec.col + VW && c < vec.c1; ++c)
                            sf_ew::store1(out + c, tmp[c - vec.col]);
                    }
                }
            }
        }
    });
}

// XA = the rows' products with projection lp's A (see the top) from its input x [m, k], and in
// e what the linear kernel needs to add their deltas to the projection's outputs; null where lp
// is not adapted or no row has an adapter. g: the rows with an adapter, grouped by slot.
template <typename T>
const sf_lora::Deltas* lora_inputs(const int64_t* lp, int64_t x, int64_t sx, int64_t k, int64_t m,
                                     const int64_t* call, const SlotRows& g, sf_lora::Deltas& e) {
    if (lp == nullptr || lp[LP_A] == 0 || g.order.empty()) return nullptr;
    const int64_t C = lp[LP_COLS], nb = sf_lin_block_width();
    if (m > kLoraStackedMaxRows) {
        lora_shrink<T>(lp, reinterpret_cast<const T*>(x), sx, k, reinterpret_cast<T*>(call[C_XA]), g, nb);
    } else {
        const int64_t r[] = {x, sx, lp[LP_A], C, k, 0, call[C_XA], C, m};
        Kernels<T>::linear(r);
    }
    e = sf_lora::Deltas{reinterpret_cast<const void*>(call[C_XA]), C, g.order.data(), g.seg.data(),
                          static_cast<int64_t>(g.seg.size()) - 1, reinterpret_cast<const int64_t*>(call[C_ROW_SLOT]),
                          nb, lp[LP_PARTS], {}};
    for (int64_t j = 0; j < lp[LP_PARTS]; ++j) {
        const int64_t* q = lp + LP_PART0 + j * LQ_FIELDS;
        e.part[j] = sf_lora::DeltaPart{reinterpret_cast<const void*>(q[LQ_B]), q[LQ_WIDTH], q[LQ_RANK], q[LQ_COL],
                                          q[LQ_OUT], q[LQ_OUT] + q[LQ_OUT_WIDTH]};
    }
    return &e;
}

template <typename T>
int run(const int64_t* shape, const int64_t* table, const int64_t* call) {
    using K = Kernels<T>;
    const int64_t T_ = call[C_T], H = shape[S_H], Hq = shape[S_HQ], Hkv = shape[S_HKV], D = shape[S_D];
    const int64_t I = shape[S_I], N = (Hq + 2 * Hkv) * D, QD = Hq * D;
    const int64_t layers = call[C_LAYERS];
    if (layers < 0 || layers > shape[S_LAYERS] || T_ < 0) return SF_DEC_BAD_SHAPE;
    if (T_ == 0 || layers == 0) return 0;
    const int64_t X = call[C_X], Y = call[C_Y], QKV = call[C_QKV], ATT = call[C_ATT], AO = call[C_AO];
    const int64_t ATTC = sizeof(T) == 2 ? call[C_ATTC] : ATT;
    const int64_t ACT = call[C_ACT], es = sizeof(T);
    const double eps = slot_double(shape[S_EPS]);
    const float scale = float(slot_double(shape[S_SCALE]));
    int64_t a[32];
    SlotRows lora_rows;
    if (call[C_LORA] &&
        !group_rows(reinterpret_cast<const int64_t*>(call[C_ROW_SLOT]), T_, call[C_LORA_SLOTS], lora_rows))
        return SF_DEC_BAD_LORA_SLOT;
    sf_lora::Deltas deltas;
    for (int64_t l = 0; l < layers; ++l) {
        const int64_t* w = table + l * L_FIELDS;
        const int64_t* lw = call[C_LORA] ? reinterpret_cast<const int64_t*>(call[C_LORA]) + l * LORA_FIELDS : nullptr;
        // Input norm: layer 0 norms X into Y; later layers add Y to the residual stream X first.
        if (l == 0) {
            const int64_t r[] = {X, H, 0, 0, w[L_NORM_IN], Y, H, 0, 0, T_, H};
            std::memcpy(a, r, sizeof(r));
        } else {
            const int64_t r[] = {Y, H, X, H, w[L_NORM_IN], Y, H, X, H, T_, H};
            std::memcpy(a, r, sizeof(r));
        }
        std::memcpy(a + 11, &eps, sizeof(eps));
        K::rms(a);
        project<T>(w + L_QKV, false, Y, H, N, H, QKV, N, T_, shape, call,  // QKV = Y . Wqkv^T
                   lora_inputs<T>(lw, Y, H, H, T_, call, lora_rows, deltas));
        const int64_t q = QKV, k = QKV + QD * es, v = QKV + (QD + Hkv * D) * es;
        {  // rotate q and k in place (views of QKV: token stride N, head stride D)
            const int64_t r[] = {q, N, D, k, N, D, q, N, D, k, N, D, call[C_POS], call[C_COS], call[C_COS_ST],
                                 call[C_SIN], call[C_SIN_ST], call[C_MAX_POS], T_, Hq, Hkv, D};
            if (K::rotary(r) >= 0) return SF_DEC_BAD_POSITION;
        }
        {
            const int64_t r[] = {k, N, D, v, N, D, w[L_K_CACHE], w[L_V_CACHE], call[C_SLOTS], T_, Hkv, D,
                                 shape[S_BLOCK], shape[S_NUM_BLOCKS], shape[S_K_LAYOUT], call[C_THREADS]};
            const int rc = shape[S_KV_KIND] != KV_INT8 ? K::write(r)
                           : sizeof(T) == 2        ? sf_attn_write_kv_i8_bf16_packed(r)
                                                   : sf_attn_write_kv_i8_f32_packed(r);
            if (rc) return rc;
        }
        {
            const int64_t r[] = {q, N, D, ATT, QD, D, w[L_K_CACHE], w[L_V_CACHE], call[C_QSL], call[C_SEQ_LENS],
                                 call[C_BT], call[C_BT_ST], call[C_BT_W], call[C_SEQS], T_, Hq, Hkv, D,
                                 shape[S_BLOCK], shape[S_NUM_BLOCKS], w[L_WINDOW], shape[S_K_LAYOUT], 0, 0,
                                 call[C_THREADS], 0, 0, shape[S_KV_KIND], sizeof(T) == 2};
            const int rc = sf_attn_paged_attention_f32_packed(r, scale);
            if (rc) return rc;
        }
        if (sizeof(T) == 2) to_bf16(reinterpret_cast<const float*>(ATT), reinterpret_cast<uint16_t*>(ATTC), T_ * QD);
        project<T>(w + L_O, false, ATTC, QD, H, QD, AO, H, T_, shape, call,  // AO = ATT . Wo^T
                   lora_inputs<T>(lw ? lw + LP_FIELDS : nullptr, ATTC, QD, QD, T_, call, lora_rows, deltas));
        {  // RES = AO + RES; AO = norm_post(RES)
            const int64_t r[] = {AO, H, X, H, w[L_NORM_POST], AO, H, X, H, T_, H};
            std::memcpy(a, r, sizeof(r));
            std::memcpy(a + 11, &eps, sizeof(eps));
            K::rms(a);
        }
        if (w[L_GATED]) {  // ACT = silu(gate (+ LoRA)) * (up (+ LoRA))
            project<T>(w + L_GATE_UP, true, AO, H, I, H, ACT, I, T_, shape, call,
                       lora_inputs<T>(lw ? lw + 2 * LP_FIELDS : nullptr, AO, H, H, T_, call, lora_rows, deltas));
        } else {  // GU = AO . Wgate_up^T (+ LoRA); ACT = silu(gate) * up
            project<T>(w + L_GATE_UP, false, AO, H, 2 * I, H, call[C_GU], 2 * I, T_, shape, call,
                       lora_inputs<T>(lw ? lw + 2 * LP_FIELDS : nullptr, AO, H, H, T_, call, lora_rows, deltas));
            const int64_t r[] = {call[C_GU], 2 * I, ACT, I, T_, I};
            K::silu_mul(r);
        }
        project<T>(w + L_DOWN, false, ACT, I, H, I, Y, H, T_, shape, call,  // Y = ACT . Wdown^T
                   lora_inputs<T>(lw ? lw + 3 * LP_FIELDS : nullptr, ACT, I, I, T_, call, lora_rows, deltas));
    }
    return 0;
}

}  // namespace

extern "C" {

// Slots per table row, shape and call (the wrapper checks it builds them to these sizes).
int sf_dec_layout(int which) {
    const int sizes[] = {L_FIELDS, S_FIELDS, C_FIELDS, LORA_FIELDS, LP_FIELDS, LQ_FIELDS};
    return which >= 0 && which < 6 ? sizes[which] : -1;
}

// Runs call[C_LAYERS] layers; 0 on success, else the failing kernel's error code (the attention
// codes of paged_attention.cpp, or SF_DEC_*). The caches may then hold some of the new K/V.
int sf_dec_forward(const int64_t* shape, const int64_t* table, const int64_t* call) {
    return shape[S_BF16] ? run<uint16_t>(shape, table, call) : run<float>(shape, table, call);
}

}  // extern "C"
