// The library's C ABI: every function the Python wrappers (kernels/cpu/*.py, through ctypes) and
// the other sources call across files, declared once. A definition that drifts from its
// declaration here no longer compiles.
#pragma once

#include <cstdint>

extern "C" {

// isa.cpp: what the library was compiled for (bits: build.py's library_isa).
int sf_build_isa();

// elementwise.cpp. "packed": one int64 array of pointers and sizes (ctypes converts each
// argument separately, so one array is cheaper than many arguments).
void sf_ew_set_parallel_threshold(int64_t elements);
int64_t sf_ew_get_parallel_threshold(void);
int sf_ew_vector_width(void);
void sf_ew_rms_norm_f32_packed(const int64_t* a);
void sf_ew_rms_norm_bf16_packed(const int64_t* a);
int64_t sf_ew_rotary_f32_packed(const int64_t* a);
int64_t sf_ew_rotary_bf16_packed(const int64_t* a);
void sf_ew_silu_and_mul_f32_packed(const int64_t* a);
void sf_ew_silu_and_mul_bf16_packed(const int64_t* a);
void sf_ew_quantize_rows_u8_packed(const int64_t* a);
void sf_ew_quantize_rows_u8_bf16_packed(const int64_t* a);
void sf_ew_dequantize_rows_f32_packed(const int64_t* a);
void sf_ew_dequantize_rows_bf16_packed(const int64_t* a);

// linear.cpp
int sf_lin_block_width(void);
int sf_lin_native_bf16(void);
int sf_lin_has_int8(void);
int sf_lin_int8_products(void);
void sf_lin_linear_f32_packed(const int64_t* a);
void sf_lin_linear_bf16_packed(const int64_t* a);
void sf_lin_linear_silu_mul_f32_packed(const int64_t* a);
void sf_lin_linear_silu_mul_bf16_packed(const int64_t* a);
void sf_lin_linear_i8_f32_packed(const int64_t* a);
void sf_lin_linear_i8_bf16_packed(const int64_t* a);
void sf_lin_linear_i8_silu_mul_f32_packed(const int64_t* a);
void sf_lin_linear_i8_silu_mul_bf16_packed(const int64_t* a);
void sf_lin_linear_lora_packed(const int64_t* a, int bf16, int gated, int int8, const void* lora);
void sf_lin_linear_addend_packed(const int64_t* a, int bf16, int gated, const void* addend, int64_t stride);

// paged_attention.cpp
int sf_attn_bf16_products();
int sf_attn_paged_attention_f32(const float* q, int64_t q_st, int64_t q_sh, float* out, int64_t o_st, int64_t o_sh,
                                const float* k_cache, const float* v_cache, const int32_t* query_start_loc,
                                const int32_t* seq_lens, const int32_t* block_tables, int64_t bt_stride, int64_t max_blocks,
                                int num_seqs, int num_tokens, int num_heads, int num_kv_heads, int head_dim,
                                int block_size, int64_t num_blocks, float scale, int window, int k_layout,
                                int num_splits, int rows_target, int num_threads, int64_t* stats, int dry_run,
                                int kv_kind, int q_bf16);
int sf_attn_write_kv_f32(const float* k, int64_t k_st, int64_t k_sh, const float* v, int64_t v_st, int64_t v_sh,
                         float* k_cache, float* v_cache, const int64_t* slot_mapping, int num_tokens, int num_kv_heads,
                         int head_dim, int block_size, int64_t num_blocks, int k_layout, int num_threads);
int sf_attn_write_kv_bf16(const uint16_t* k, int64_t k_st, int64_t k_sh, const uint16_t* v, int64_t v_st,
                          int64_t v_sh, uint16_t* k_cache, uint16_t* v_cache, const int64_t* slot_mapping,
                          int num_tokens, int num_kv_heads, int head_dim, int block_size, int64_t num_blocks,
                          int k_layout, int num_threads);
int sf_attn_paged_attention_f32_packed(const int64_t* p, float scale);
int sf_attn_write_kv_f32_packed(const int64_t* p);
int sf_attn_write_kv_bf16_packed(const int64_t* p);
int sf_attn_write_kv_i8_f32_packed(const int64_t* p);   // into int8 caches (kv_int8.h)
int sf_attn_write_kv_i8_bf16_packed(const int64_t* p);

// quant4.cpp (GGUF blocks: kind 0 Q4_0, 1 Q4_1, 2 Q8_0)
int sf_q4_block_width(void);
int64_t sf_q4_record_bytes(int kind);
int sf_q4_dot_products(void);
void sf_q4_linear_q4_0(const int64_t* a);
void sf_q4_linear_q4_1(const int64_t* a);
void sf_q4_linear_q8_0(const int64_t* a);
void sf_q4_linear_silu_mul_q4_0(const int64_t* a);
void sf_q4_linear_silu_mul_q4_1(const int64_t* a);
void sf_q4_linear_silu_mul_q8_0(const int64_t* a);
void sf_q4_dot_q4_0(const int64_t* a);
void sf_q4_dot_q4_1(const int64_t* a);
void sf_q4_dot_q8_0(const int64_t* a);
void sf_q4_dot_silu_mul_q4_0(const int64_t* a);
void sf_q4_dot_silu_mul_q4_1(const int64_t* a);
void sf_q4_dot_silu_mul_q8_0(const int64_t* a);
int sf_q4_dot_kinds(void);
// Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: the same two forms, gated or not.
#define SF_Q4_DECLARE(name)                                   \
    void sf_q4_linear_##name(const int64_t* a);               \
    void sf_q4_linear_silu_mul_##name(const int64_t* a);      \
    void sf_q4_dot_##name(const int64_t* a);                  \
    void sf_q4_dot_silu_mul_##name(const int64_t* a);
SF_Q4_DECLARE(q5_0)
SF_Q4_DECLARE(q5_1)
SF_Q4_DECLARE(q4_k)
SF_Q4_DECLARE(q5_k)
SF_Q4_DECLARE(q6_k)
#undef SF_Q4_DECLARE
void sf_q4_linear_any(const int64_t* a, int kind, int dot, int gated, const void* lora);

// decoder.cpp
int sf_dec_layout(int which);
int sf_dec_forward(const int64_t* shape, const int64_t* table, const int64_t* call);

}  // extern "C"
