// Block structs of the ggml formats (ggml-common.h style), GENERATED from the format registry
// (hanzo_torch/formats) by `python -m hanzo_torch.formats.codegen`: edit the registry, not this
// file. tests/test_formats_codegen.py fails when the two differ.
#pragma once
#include <stddef.h>
#include <stdint.h>

typedef uint16_t ggml_half;  // IEEE fp16 bits

// ggml's activation block types (vec_dot_type) a weight block is dotted with
enum HzVecDotType { HZ_VEC_DOT_Q8_0 = 0, HZ_VEC_DOT_Q8_1 = 1, HZ_VEC_DOT_Q8_K = 2 };

// Constant tables installed at run time (hz_tables[slot], from the registry's tables)
enum HzTableSlot {
    HZ_TABLE_IQ2_XXS_GRID = 0,
    HZ_TABLE_IQ2_XS_GRID = 1,
    HZ_TABLE_IQ3_XXS_GRID = 2,
    HZ_TABLE_IQ1_S_GRID = 3,
    HZ_TABLE_IQ3_S_GRID = 4,
    HZ_TABLE_IQ2_S_GRID = 5,
    HZ_TABLE_IQ1_M_GRID = 3,
    HZ_N_TABLES = 6
};
static const int64_t hz_table_numel[HZ_N_TABLES] = {2048, 4096, 1024, 16384, 2048, 8192};

// Q4_0: ggml type 2, 32 values in 18 bytes, 32 values per scale group, dotted with q8_0
struct block_q4_0 {
    ggml_half d;
    uint8_t qs[16];
    static constexpr int type_id = 2, qk = 32, group_len = 32;
    static constexpr HzVecDotType vec_dot_type = HZ_VEC_DOT_Q8_0;
};
static_assert(sizeof(block_q4_0) == 18, "wrong Q4_0 block size");
static_assert(offsetof(block_q4_0, d) == 0, "wrong offset of Q4_0.d");
static_assert(offsetof(block_q4_0, qs) == 2, "wrong offset of Q4_0.qs");

// Q4_1: ggml type 3, 32 values in 20 bytes, 32 values per scale group, dotted with q8_1
struct block_q4_1 {
    ggml_half d;
    ggml_half m;
    uint8_t qs[16];
    static constexpr int type_id = 3, qk = 32, group_len = 32;
    static constexpr HzVecDotType vec_dot_type = HZ_VEC_DOT_Q8_1;
};
static_assert(sizeof(block_q4_1) == 20, "wrong Q4_1 block size");
static_assert(offsetof(block_q4_1, d) == 0, "wrong offset of Q4_1.d");
static_assert(offsetof(block_q4_1, m) == 2, "wrong offset of Q4_1.m");
static_assert(offsetof(block_q4_1, qs) == 4, "wrong offset of Q4_1.qs");

// Q5_0: ggml type 6, 32 values in 22 bytes, 32 values per scale group, dotted with q8_0
struct block_q5_0 {
    ggml_half d;
    uint8_t qh[4];
    uint8_t qs[16];
    static constexpr int type_id = 6, qk = 32, group_len = 32;
    static constexpr HzVecDotType vec_dot_type = HZ_VEC_DOT_Q8_0;
};
static_assert(sizeof(block_q5_0) == 22, "wrong Q5_0 block size");
static_assert(offsetof(block_q5_0, d) == 0, "wrong offset of Q5_0.d");
static_assert(offsetof(block_q5_0, qh) == 2, "wrong offset of Q5_0.qh");
static_assert(offsetof(block_q5_0, qs) == 6, "wrong offset of Q5_0.qs");

// Q5_1: ggml type 7, 32 values in 24 bytes, 32 values per scale group, dotted with q8_1
struct block_q5_1 {
    ggml_half d;
    ggml_half m;
    uint8_t qh[4];
    uint8_t qs[16];
    static constexpr int type_id = 7, qk = 32, group_len = 32;
    static constexpr HzVecDotType vec_dot_type = HZ_VEC_DOT_Q8_1;
};
static_assert(sizeof(block_q5_1) == 24, "wrong Q5_1 block size");
static_assert(offsetof(block_q5_1, d) == 0, "wrong offset of Q5_1.d");
static_assert(offsetof(block_q5_1, m) == 2, "wrong offset of Q5_1.m");
static_assert(offsetof(block_q5_1, qh) == 4, "wrong offset of Q5_1.qh");
static_assert(offsetof(block_q5_1, qs) == 8, "wrong offset of Q5_1.qs");

// Q8_0: ggml type 8, 32 values in 34 bytes, 32 values per scale group, dotted with q8_0
struct block_q8_0 {
    ggml_half d;
    int8_t qs[32];
    static constexpr int type_id = 8, qk = 32, group_len = 32;
    static constexpr HzVecDotType vec_dot_type = HZ_VEC_DOT_Q8_0;
};
static_assert(sizeof(block_q8_0) == 34, "wrong Q8_0 block size");
static_assert(offsetof(block_q8_0, d) == 0, "wrong offset of Q8_0.d");
static_assert(offsetof(block_q8_0, qs) == 2, "wrong offset of Q8_0.qs");

// Q2_K: ggml type 10, 256 values in 84 bytes, 16 values per scale group, dotted with q8_K
struct block_q2_K {
    uint8_t scales[16];
    uint8_t qs[64];
    ggml_half d;
    ggml_half dmin;
    static constexpr int type_id = 10, qk = 256, group_len = 16;
    static constexpr HzVecDotType vec_dot_type = HZ_VEC_DOT_Q8_K;
};
static_assert(sizeof(block_q2_K) == 84, "wrong Q2_K block size");
static_assert(offsetof(block_q2_K, scales) == 0, "wrong offset of Q2_K.scales");
static_assert(offsetof(block_q2_K, qs) == 16, "wrong offset of Q2_K.qs");
static_assert(offsetof(block_q2_K, d) == 80, "wrong offset of Q2_K.d");
static_assert(offsetof(block_q2_K, dmin) == 82, "wrong offset of Q2_K.dmin");

// Q3_K: ggml type 11, 256 values in 110 bytes, 16 values per scale group, dotted with q8_K
struct block_q3_K {
    uint8_t hmask[32];
    uint8_t qs[64];
    uint8_t scales[12];
    ggml_half d;
    static constexpr int type_id = 11, qk = 256, group_len = 16;
    static constexpr HzVecDotType vec_dot_type = HZ_VEC_DOT_Q8_K;
};
static_assert(sizeof(block_q3_K) == 110, "wrong Q3_K block size");
static_assert(offsetof(block_q3_K, hmask) == 0, "wrong offset of Q3_K.hmask");
static_assert(offsetof(block_q3_K, qs) == 32, "wrong offset of Q3_K.qs");
static_assert(offsetof(block_q3_K, scales) == 96, "wrong offset of Q3_K.scales");
static_assert(offsetof(block_q3_K, d) == 108, "wrong offset of Q3_K.d");

// Q4_K: ggml type 12, 256 values in 144 bytes, 32 values per scale group, dotted with q8_K
struct block_q4_K {
    ggml_half d;
    ggml_half dmin;
    uint8_t scales[12];
    uint8_t qs[128];
    static constexpr int type_id = 12, qk = 256, group_len = 32;
    static constexpr HzVecDotType vec_dot_type = HZ_VEC_DOT_Q8_K;
};
static_assert(sizeof(block_q4_K) == 144, "wrong Q4_K block size");
static_assert(offsetof(block_q4_K, d) == 0, "wrong offset of Q4_K.d");
static_assert(offsetof(block_q4_K, dmin) == 2, "wrong offset of Q4_K.dmin");
static_assert(offsetof(block_q4_K, scales) == 4, "wrong offset of Q4_K.scales");
static_assert(offsetof(block_q4_K, qs) == 16, "wrong offset of Q4_K.qs");

// Q5_K: ggml type 13, 256 values in 176 bytes, 32 values per scale group, dotted with q8_K
struct block_q5_K {
    ggml_half d;
    ggml_half dmin;
    uint8_t scales[12];
    uint8_t qh[32];
    uint8_t qs[128];
    static constexpr int type_id = 13, qk = 256, group_len = 32;
    static constexpr HzVecDotType vec_dot_type = HZ_VEC_DOT_Q8_K;
};
static_assert(sizeof(block_q5_K) == 176, "wrong Q5_K block size");
static_assert(offsetof(block_q5_K, d) == 0, "wrong offset of Q5_K.d");
static_assert(offsetof(block_q5_K, dmin) == 2, "wrong offset of Q5_K.dmin");
static_assert(offsetof(block_q5_K, scales) == 4, "wrong offset of Q5_K.scales");
static_assert(offsetof(block_q5_K, qh) == 16, "wrong offset of Q5_K.qh");
static_assert(offsetof(block_q5_K, qs) == 48, "wrong offset of Q5_K.qs");

// Q6_K: ggml type 14, 256 values in 210 bytes, 16 values per scale group, dotted with q8_K
struct block_q6_K {
    uint8_t ql[128];
    uint8_t qh[64];
    int8_t scales[16];
    ggml_half d;
    static constexpr int type_id = 14, qk = 256, group_len = 16;
    static constexpr HzVecDotType vec_dot_type = HZ_VEC_DOT_Q8_K;
};
static_assert(sizeof(block_q6_K) == 210, "wrong Q6_K block size");
static_assert(offsetof(block_q6_K, ql) == 0, "wrong offset of Q6_K.ql");
static_assert(offsetof(block_q6_K, qh) == 128, "wrong offset of Q6_K.qh");
static_assert(offsetof(block_q6_K, scales) == 192, "wrong offset of Q6_K.scales");
static_assert(offsetof(block_q6_K, d) == 208, "wrong offset of Q6_K.d");

// IQ2_XXS: ggml type 16, 256 values in 66 bytes, 32 values per scale group, dotted with q8_K
struct block_iq2_xxs {
    ggml_half d;
    uint16_t qs[32];
    static constexpr int type_id = 16, qk = 256, group_len = 32;
    static constexpr HzVecDotType vec_dot_type = HZ_VEC_DOT_Q8_K;
};
static_assert(sizeof(block_iq2_xxs) == 66, "wrong IQ2_XXS block size");
static_assert(offsetof(block_iq2_xxs, d) == 0, "wrong offset of IQ2_XXS.d");
static_assert(offsetof(block_iq2_xxs, qs) == 2, "wrong offset of IQ2_XXS.qs");

// IQ2_XS: ggml type 17, 256 values in 74 bytes, 16 values per scale group, dotted with q8_K
struct block_iq2_xs {
    ggml_half d;
    uint16_t qs[32];
    uint8_t scales[8];
    static constexpr int type_id = 17, qk = 256, group_len = 16;
    static constexpr HzVecDotType vec_dot_type = HZ_VEC_DOT_Q8_K;
};
static_assert(sizeof(block_iq2_xs) == 74, "wrong IQ2_XS block size");
static_assert(offsetof(block_iq2_xs, d) == 0, "wrong offset of IQ2_XS.d");
static_assert(offsetof(block_iq2_xs, qs) == 2, "wrong offset of IQ2_XS.qs");
static_assert(offsetof(block_iq2_xs, scales) == 66, "wrong offset of IQ2_XS.scales");

// IQ3_XXS: ggml type 18, 256 values in 98 bytes, 32 values per scale group, dotted with q8_K
struct block_iq3_xxs {
    ggml_half d;
    uint8_t qs[96];
    static constexpr int type_id = 18, qk = 256, group_len = 32;
    static constexpr HzVecDotType vec_dot_type = HZ_VEC_DOT_Q8_K;
};
static_assert(sizeof(block_iq3_xxs) == 98, "wrong IQ3_XXS block size");
static_assert(offsetof(block_iq3_xxs, d) == 0, "wrong offset of IQ3_XXS.d");
static_assert(offsetof(block_iq3_xxs, qs) == 2, "wrong offset of IQ3_XXS.qs");

// IQ1_S: ggml type 19, 256 values in 50 bytes, 32 values per scale group, dotted with q8_K
struct block_iq1_s {
    ggml_half d;
    uint8_t qs[32];
    uint16_t qh[8];
    static constexpr int type_id = 19, qk = 256, group_len = 32;
    static constexpr HzVecDotType vec_dot_type = HZ_VEC_DOT_Q8_K;
};
static_assert(sizeof(block_iq1_s) == 50, "wrong IQ1_S block size");
static_assert(offsetof(block_iq1_s, d) == 0, "wrong offset of IQ1_S.d");
static_assert(offsetof(block_iq1_s, qs) == 2, "wrong offset of IQ1_S.qs");
static_assert(offsetof(block_iq1_s, qh) == 34, "wrong offset of IQ1_S.qh");

// IQ4_NL: ggml type 20, 32 values in 18 bytes, 32 values per scale group, dotted with q8_0
struct block_iq4_nl {
    ggml_half d;
    uint8_t qs[16];
    static constexpr int type_id = 20, qk = 32, group_len = 32;
    static constexpr HzVecDotType vec_dot_type = HZ_VEC_DOT_Q8_0;
};
static_assert(sizeof(block_iq4_nl) == 18, "wrong IQ4_NL block size");
static_assert(offsetof(block_iq4_nl, d) == 0, "wrong offset of IQ4_NL.d");
static_assert(offsetof(block_iq4_nl, qs) == 2, "wrong offset of IQ4_NL.qs");
static const int8_t hz_kvalues_iq4_nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// IQ3_S: ggml type 21, 256 values in 110 bytes, 32 values per scale group, dotted with q8_K
struct block_iq3_s {
    ggml_half d;
    uint8_t qs[64];
    uint8_t qh[8];
    uint8_t signs[32];
    uint8_t scales[4];
    static constexpr int type_id = 21, qk = 256, group_len = 32;
    static constexpr HzVecDotType vec_dot_type = HZ_VEC_DOT_Q8_K;
};
static_assert(sizeof(block_iq3_s) == 110, "wrong IQ3_S block size");
static_assert(offsetof(block_iq3_s, d) == 0, "wrong offset of IQ3_S.d");
static_assert(offsetof(block_iq3_s, qs) == 2, "wrong offset of IQ3_S.qs");
static_assert(offsetof(block_iq3_s, qh) == 66, "wrong offset of IQ3_S.qh");
static_assert(offsetof(block_iq3_s, signs) == 74, "wrong offset of IQ3_S.signs");
static_assert(offsetof(block_iq3_s, scales) == 106, "wrong offset of IQ3_S.scales");

// IQ2_S: ggml type 22, 256 values in 82 bytes, 16 values per scale group, dotted with q8_K
struct block_iq2_s {
    ggml_half d;
    uint8_t qs[64];
    uint8_t qh[8];
    uint8_t scales[8];
    static constexpr int type_id = 22, qk = 256, group_len = 16;
    static constexpr HzVecDotType vec_dot_type = HZ_VEC_DOT_Q8_K;
};
static_assert(sizeof(block_iq2_s) == 82, "wrong IQ2_S block size");
static_assert(offsetof(block_iq2_s, d) == 0, "wrong offset of IQ2_S.d");
static_assert(offsetof(block_iq2_s, qs) == 2, "wrong offset of IQ2_S.qs");
static_assert(offsetof(block_iq2_s, qh) == 66, "wrong offset of IQ2_S.qh");
static_assert(offsetof(block_iq2_s, scales) == 74, "wrong offset of IQ2_S.scales");

// IQ4_XS: ggml type 23, 256 values in 136 bytes, 32 values per scale group, dotted with q8_K
struct block_iq4_xs {
    ggml_half d;
    uint16_t scales_h;
    uint8_t scales_l[4];
    uint8_t qs[128];
    static constexpr int type_id = 23, qk = 256, group_len = 32;
    static constexpr HzVecDotType vec_dot_type = HZ_VEC_DOT_Q8_K;
};
static_assert(sizeof(block_iq4_xs) == 136, "wrong IQ4_XS block size");
static_assert(offsetof(block_iq4_xs, d) == 0, "wrong offset of IQ4_XS.d");
static_assert(offsetof(block_iq4_xs, scales_h) == 2, "wrong offset of IQ4_XS.scales_h");
static_assert(offsetof(block_iq4_xs, scales_l) == 4, "wrong offset of IQ4_XS.scales_l");
static_assert(offsetof(block_iq4_xs, qs) == 8, "wrong offset of IQ4_XS.qs");
static const int8_t hz_kvalues_iq4_xs[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// IQ1_M: ggml type 29, 256 values in 56 bytes, 8 values per scale group, dotted with q8_K
struct block_iq1_m {
    uint8_t qs[32];
    uint8_t qh[16];
    uint8_t scales[8];
    static constexpr int type_id = 29, qk = 256, group_len = 8;
    static constexpr HzVecDotType vec_dot_type = HZ_VEC_DOT_Q8_K;
};
static_assert(sizeof(block_iq1_m) == 56, "wrong IQ1_M block size");
static_assert(offsetof(block_iq1_m, qs) == 0, "wrong offset of IQ1_M.qs");
static_assert(offsetof(block_iq1_m, qh) == 32, "wrong offset of IQ1_M.qh");
static_assert(offsetof(block_iq1_m, scales) == 48, "wrong offset of IQ1_M.scales");

// TQ1_0: ggml type 34, 256 values in 54 bytes, 32 values per scale group, dotted with q8_K
struct block_tq1_0 {
    uint8_t qs[48];
    uint8_t qh[4];
    ggml_half d;
    static constexpr int type_id = 34, qk = 256, group_len = 32;
    static constexpr HzVecDotType vec_dot_type = HZ_VEC_DOT_Q8_K;
};
static_assert(sizeof(block_tq1_0) == 54, "wrong TQ1_0 block size");
static_assert(offsetof(block_tq1_0, qs) == 0, "wrong offset of TQ1_0.qs");
static_assert(offsetof(block_tq1_0, qh) == 48, "wrong offset of TQ1_0.qh");
static_assert(offsetof(block_tq1_0, d) == 52, "wrong offset of TQ1_0.d");

// TQ2_0: ggml type 35, 256 values in 66 bytes, 32 values per scale group, dotted with q8_K
struct block_tq2_0 {
    uint8_t qs[64];
    ggml_half d;
    static constexpr int type_id = 35, qk = 256, group_len = 32;
    static constexpr HzVecDotType vec_dot_type = HZ_VEC_DOT_Q8_K;
};
static_assert(sizeof(block_tq2_0) == 66, "wrong TQ2_0 block size");
static_assert(offsetof(block_tq2_0, qs) == 0, "wrong offset of TQ2_0.qs");
static_assert(offsetof(block_tq2_0, d) == 64, "wrong offset of TQ2_0.d");

// MXFP4: ggml type 39, 32 values in 17 bytes, 32 values per scale group, dotted with q8_0
struct block_mxfp4 {
    uint8_t e;
    uint8_t qs[16];
    static constexpr int type_id = 39, qk = 32, group_len = 32;
    static constexpr HzVecDotType vec_dot_type = HZ_VEC_DOT_Q8_0;
};
static_assert(sizeof(block_mxfp4) == 17, "wrong MXFP4 block size");
static_assert(offsetof(block_mxfp4, e) == 0, "wrong offset of MXFP4.e");
static_assert(offsetof(block_mxfp4, qs) == 1, "wrong offset of MXFP4.qs");
static const int8_t hz_kvalues_mxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// NVFP4: ggml type 40, 64 values in 36 bytes, 16 values per scale group, dotted with q8_0
struct block_nvfp4 {
    uint8_t d[4];
    uint8_t qs[32];
    static constexpr int type_id = 40, qk = 64, group_len = 16;
    static constexpr HzVecDotType vec_dot_type = HZ_VEC_DOT_Q8_0;
};
static_assert(sizeof(block_nvfp4) == 36, "wrong NVFP4 block size");
static_assert(offsetof(block_nvfp4, d) == 0, "wrong offset of NVFP4.d");
static_assert(offsetof(block_nvfp4, qs) == 4, "wrong offset of NVFP4.qs");
static const int8_t hz_kvalues_nvfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// Q1_0: ggml type 41, 128 values in 18 bytes, 128 values per scale group, dotted with q8_0
struct block_q1_0 {
    ggml_half d;
    uint8_t qs[16];
    static constexpr int type_id = 41, qk = 128, group_len = 128;
    static constexpr HzVecDotType vec_dot_type = HZ_VEC_DOT_Q8_0;
};
static_assert(sizeof(block_q1_0) == 18, "wrong Q1_0 block size");
static_assert(offsetof(block_q1_0, d) == 0, "wrong offset of Q1_0.d");
static_assert(offsetof(block_q1_0, qs) == 2, "wrong offset of Q1_0.qs");
