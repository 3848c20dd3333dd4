// Block layouts and tables of the ggml formats for the Vulkan shaders, GENERATED from the format
// registry (hanzo_torch/formats) by `python -m hanzo_torch.formats.codegen`: edit the registry, not
// this file. tests/test_formats_codegen.py fails when the two differ.
// Per format NAME: HZ_NAME_TYPE_ID (ggml type id), HZ_NAME_QK (values per block), HZ_NAME_TS
// (bytes per block), HZ_NAME_GROUP_LEN (values per scale group, 0 for dense types) and
// HZ_NAME_<field>: the byte offset of each field of ggml's block struct. Tables of up to 64 entries
// are const int[] arrays, compiled in when a format that reads them (HZ_FMT_<NAME>) or
// HZ_ALL_TABLES is defined; larger ones (HZ_NAME_TABLE_<TABLE>_NUMEL int8 entries) are uploaded
// at run time from the same registry tables and read through the shader's table address.
#ifndef HZ_GGML_BLOCKS_GLSL
#define HZ_GGML_BLOCKS_GLSL

// F32: ggml type 0, 1 values in 4 bytes, dense
#define HZ_F32_TYPE_ID 0
#define HZ_F32_QK 1u
#define HZ_F32_TS 4u
#define HZ_F32_GROUP_LEN 0u
#define HZ_F32_v 0u  // float v

// F16: ggml type 1, 1 values in 2 bytes, dense
#define HZ_F16_TYPE_ID 1
#define HZ_F16_QK 1u
#define HZ_F16_TS 2u
#define HZ_F16_GROUP_LEN 0u
#define HZ_F16_v 0u  // ggml_half v

// BF16: ggml type 30, 1 values in 2 bytes, dense
#define HZ_BF16_TYPE_ID 30
#define HZ_BF16_QK 1u
#define HZ_BF16_TS 2u
#define HZ_BF16_GROUP_LEN 0u
#define HZ_BF16_v 0u  // uint16_t v

// Q4_0: ggml type 2, 32 values in 18 bytes, 32 values per scale group, dotted with q8_0
#define HZ_Q4_0_TYPE_ID 2
#define HZ_Q4_0_QK 32u
#define HZ_Q4_0_TS 18u
#define HZ_Q4_0_GROUP_LEN 32u
#define HZ_Q4_0_d 0u  // ggml_half d
#define HZ_Q4_0_qs 2u  // uint8_t qs[16]

// Q4_1: ggml type 3, 32 values in 20 bytes, 32 values per scale group, dotted with q8_1
#define HZ_Q4_1_TYPE_ID 3
#define HZ_Q4_1_QK 32u
#define HZ_Q4_1_TS 20u
#define HZ_Q4_1_GROUP_LEN 32u
#define HZ_Q4_1_d 0u  // ggml_half d
#define HZ_Q4_1_m 2u  // ggml_half m
#define HZ_Q4_1_qs 4u  // uint8_t qs[16]

// Q5_0: ggml type 6, 32 values in 22 bytes, 32 values per scale group, dotted with q8_0
#define HZ_Q5_0_TYPE_ID 6
#define HZ_Q5_0_QK 32u
#define HZ_Q5_0_TS 22u
#define HZ_Q5_0_GROUP_LEN 32u
#define HZ_Q5_0_d 0u  // ggml_half d
#define HZ_Q5_0_qh 2u  // uint8_t qh[4]
#define HZ_Q5_0_qs 6u  // uint8_t qs[16]

// Q5_1: ggml type 7, 32 values in 24 bytes, 32 values per scale group, dotted with q8_1
#define HZ_Q5_1_TYPE_ID 7
#define HZ_Q5_1_QK 32u
#define HZ_Q5_1_TS 24u
#define HZ_Q5_1_GROUP_LEN 32u
#define HZ_Q5_1_d 0u  // ggml_half d
#define HZ_Q5_1_m 2u  // ggml_half m
#define HZ_Q5_1_qh 4u  // uint8_t qh[4]
#define HZ_Q5_1_qs 8u  // uint8_t qs[16]

// Q8_0: ggml type 8, 32 values in 34 bytes, 32 values per scale group, dotted with q8_0
#define HZ_Q8_0_TYPE_ID 8
#define HZ_Q8_0_QK 32u
#define HZ_Q8_0_TS 34u
#define HZ_Q8_0_GROUP_LEN 32u
#define HZ_Q8_0_d 0u  // ggml_half d
#define HZ_Q8_0_qs 2u  // int8_t qs[32]

// Q2_K: ggml type 10, 256 values in 84 bytes, 16 values per scale group, dotted with q8_K
#define HZ_Q2_K_TYPE_ID 10
#define HZ_Q2_K_QK 256u
#define HZ_Q2_K_TS 84u
#define HZ_Q2_K_GROUP_LEN 16u
#define HZ_Q2_K_scales 0u  // uint8_t scales[16]
#define HZ_Q2_K_qs 16u  // uint8_t qs[64]
#define HZ_Q2_K_d 80u  // ggml_half d
#define HZ_Q2_K_dmin 82u  // ggml_half dmin

// Q3_K: ggml type 11, 256 values in 110 bytes, 16 values per scale group, dotted with q8_K
#define HZ_Q3_K_TYPE_ID 11
#define HZ_Q3_K_QK 256u
#define HZ_Q3_K_TS 110u
#define HZ_Q3_K_GROUP_LEN 16u
#define HZ_Q3_K_hmask 0u  // uint8_t hmask[32]
#define HZ_Q3_K_qs 32u  // uint8_t qs[64]
#define HZ_Q3_K_scales 96u  // uint8_t scales[12]
#define HZ_Q3_K_d 108u  // ggml_half d

// Q4_K: ggml type 12, 256 values in 144 bytes, 32 values per scale group, dotted with q8_K
#define HZ_Q4_K_TYPE_ID 12
#define HZ_Q4_K_QK 256u
#define HZ_Q4_K_TS 144u
#define HZ_Q4_K_GROUP_LEN 32u
#define HZ_Q4_K_d 0u  // ggml_half d
#define HZ_Q4_K_dmin 2u  // ggml_half dmin
#define HZ_Q4_K_scales 4u  // uint8_t scales[12]
#define HZ_Q4_K_qs 16u  // uint8_t qs[128]

// Q5_K: ggml type 13, 256 values in 176 bytes, 32 values per scale group, dotted with q8_K
#define HZ_Q5_K_TYPE_ID 13
#define HZ_Q5_K_QK 256u
#define HZ_Q5_K_TS 176u
#define HZ_Q5_K_GROUP_LEN 32u
#define HZ_Q5_K_d 0u  // ggml_half d
#define HZ_Q5_K_dmin 2u  // ggml_half dmin
#define HZ_Q5_K_scales 4u  // uint8_t scales[12]
#define HZ_Q5_K_qh 16u  // uint8_t qh[32]
#define HZ_Q5_K_qs 48u  // uint8_t qs[128]

// Q6_K: ggml type 14, 256 values in 210 bytes, 16 values per scale group, dotted with q8_K
#define HZ_Q6_K_TYPE_ID 14
#define HZ_Q6_K_QK 256u
#define HZ_Q6_K_TS 210u
#define HZ_Q6_K_GROUP_LEN 16u
#define HZ_Q6_K_ql 0u  // uint8_t ql[128]
#define HZ_Q6_K_qh 128u  // uint8_t qh[64]
#define HZ_Q6_K_scales 192u  // int8_t scales[16]
#define HZ_Q6_K_d 208u  // ggml_half d

// IQ2_XXS: ggml type 16, 256 values in 66 bytes, 32 values per scale group, dotted with q8_K
#define HZ_IQ2_XXS_TYPE_ID 16
#define HZ_IQ2_XXS_QK 256u
#define HZ_IQ2_XXS_TS 66u
#define HZ_IQ2_XXS_GROUP_LEN 32u
#define HZ_IQ2_XXS_d 0u  // ggml_half d
#define HZ_IQ2_XXS_qs 2u  // uint16_t qs[32]
#define HZ_IQ2_XXS_TABLE_GRID_NUMEL 2048u  // int8 (256, 8), uploaded at run time

// IQ2_XS: ggml type 17, 256 values in 74 bytes, 16 values per scale group, dotted with q8_K
#define HZ_IQ2_XS_TYPE_ID 17
#define HZ_IQ2_XS_QK 256u
#define HZ_IQ2_XS_TS 74u
#define HZ_IQ2_XS_GROUP_LEN 16u
#define HZ_IQ2_XS_d 0u  // ggml_half d
#define HZ_IQ2_XS_qs 2u  // uint16_t qs[32]
#define HZ_IQ2_XS_scales 66u  // uint8_t scales[8]
#define HZ_IQ2_XS_TABLE_GRID_NUMEL 4096u  // int8 (512, 8), uploaded at run time

// IQ3_XXS: ggml type 18, 256 values in 98 bytes, 32 values per scale group, dotted with q8_K
#define HZ_IQ3_XXS_TYPE_ID 18
#define HZ_IQ3_XXS_QK 256u
#define HZ_IQ3_XXS_TS 98u
#define HZ_IQ3_XXS_GROUP_LEN 32u
#define HZ_IQ3_XXS_d 0u  // ggml_half d
#define HZ_IQ3_XXS_qs 2u  // uint8_t qs[96]
#define HZ_IQ3_XXS_TABLE_GRID_NUMEL 1024u  // int8 (256, 4), uploaded at run time

// IQ1_S: ggml type 19, 256 values in 50 bytes, 32 values per scale group, dotted with q8_K
#define HZ_IQ1_S_TYPE_ID 19
#define HZ_IQ1_S_QK 256u
#define HZ_IQ1_S_TS 50u
#define HZ_IQ1_S_GROUP_LEN 32u
#define HZ_IQ1_S_d 0u  // ggml_half d
#define HZ_IQ1_S_qs 2u  // uint8_t qs[32]
#define HZ_IQ1_S_qh 34u  // uint16_t qh[8]
#define HZ_IQ1_S_TABLE_GRID_NUMEL 16384u  // int8 (2048, 8), uploaded at run time

// IQ4_NL: ggml type 20, 32 values in 18 bytes, 32 values per scale group, dotted with q8_0
#define HZ_IQ4_NL_TYPE_ID 20
#define HZ_IQ4_NL_QK 32u
#define HZ_IQ4_NL_TS 18u
#define HZ_IQ4_NL_GROUP_LEN 32u
#define HZ_IQ4_NL_d 0u  // ggml_half d
#define HZ_IQ4_NL_qs 2u  // uint8_t qs[16]
#define HZ_IQ4_NL_TABLE_KVALUES hz_kvalues_iq4_nl  // 16 int8 entries, (16,)
#if defined(HZ_FMT_IQ4_NL) || defined(HZ_FMT_IQ4_XS) || defined(HZ_ALL_TABLES)
const int hz_kvalues_iq4_nl[16] = int[](-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
#endif

// IQ3_S: ggml type 21, 256 values in 110 bytes, 32 values per scale group, dotted with q8_K
#define HZ_IQ3_S_TYPE_ID 21
#define HZ_IQ3_S_QK 256u
#define HZ_IQ3_S_TS 110u
#define HZ_IQ3_S_GROUP_LEN 32u
#define HZ_IQ3_S_d 0u  // ggml_half d
#define HZ_IQ3_S_qs 2u  // uint8_t qs[64]
#define HZ_IQ3_S_qh 66u  // uint8_t qh[8]
#define HZ_IQ3_S_signs 74u  // uint8_t signs[32]
#define HZ_IQ3_S_scales 106u  // uint8_t scales[4]
#define HZ_IQ3_S_TABLE_GRID_NUMEL 2048u  // int8 (512, 4), uploaded at run time

// IQ2_S: ggml type 22, 256 values in 82 bytes, 16 values per scale group, dotted with q8_K
#define HZ_IQ2_S_TYPE_ID 22
#define HZ_IQ2_S_QK 256u
#define HZ_IQ2_S_TS 82u
#define HZ_IQ2_S_GROUP_LEN 16u
#define HZ_IQ2_S_d 0u  // ggml_half d
#define HZ_IQ2_S_qs 2u  // uint8_t qs[64]
#define HZ_IQ2_S_qh 66u  // uint8_t qh[8]
#define HZ_IQ2_S_scales 74u  // uint8_t scales[8]
#define HZ_IQ2_S_TABLE_GRID_NUMEL 8192u  // int8 (1024, 8), uploaded at run time

// IQ4_XS: ggml type 23, 256 values in 136 bytes, 32 values per scale group, dotted with q8_K
#define HZ_IQ4_XS_TYPE_ID 23
#define HZ_IQ4_XS_QK 256u
#define HZ_IQ4_XS_TS 136u
#define HZ_IQ4_XS_GROUP_LEN 32u
#define HZ_IQ4_XS_d 0u  // ggml_half d
#define HZ_IQ4_XS_scales_h 2u  // uint16_t scales_h
#define HZ_IQ4_XS_scales_l 4u  // uint8_t scales_l[4]
#define HZ_IQ4_XS_qs 8u  // uint8_t qs[128]
#define HZ_IQ4_XS_TABLE_KVALUES hz_kvalues_iq4_nl  // 16 int8 entries, (16,)

// IQ1_M: ggml type 29, 256 values in 56 bytes, 8 values per scale group, dotted with q8_K
#define HZ_IQ1_M_TYPE_ID 29
#define HZ_IQ1_M_QK 256u
#define HZ_IQ1_M_TS 56u
#define HZ_IQ1_M_GROUP_LEN 8u
#define HZ_IQ1_M_qs 0u  // uint8_t qs[32]
#define HZ_IQ1_M_qh 32u  // uint8_t qh[16]
#define HZ_IQ1_M_scales 48u  // uint8_t scales[8]
#define HZ_IQ1_M_TABLE_GRID_NUMEL 16384u  // int8 (2048, 8), uploaded at run time

// TQ1_0: ggml type 34, 256 values in 54 bytes, 32 values per scale group, dotted with q8_K
#define HZ_TQ1_0_TYPE_ID 34
#define HZ_TQ1_0_QK 256u
#define HZ_TQ1_0_TS 54u
#define HZ_TQ1_0_GROUP_LEN 32u
#define HZ_TQ1_0_qs 0u  // uint8_t qs[48]
#define HZ_TQ1_0_qh 48u  // uint8_t qh[4]
#define HZ_TQ1_0_d 52u  // ggml_half d

// TQ2_0: ggml type 35, 256 values in 66 bytes, 32 values per scale group, dotted with q8_K
#define HZ_TQ2_0_TYPE_ID 35
#define HZ_TQ2_0_QK 256u
#define HZ_TQ2_0_TS 66u
#define HZ_TQ2_0_GROUP_LEN 32u
#define HZ_TQ2_0_qs 0u  // uint8_t qs[64]
#define HZ_TQ2_0_d 64u  // ggml_half d

// MXFP4: ggml type 39, 32 values in 17 bytes, 32 values per scale group, dotted with q8_0
#define HZ_MXFP4_TYPE_ID 39
#define HZ_MXFP4_QK 32u
#define HZ_MXFP4_TS 17u
#define HZ_MXFP4_GROUP_LEN 32u
#define HZ_MXFP4_e 0u  // uint8_t e
#define HZ_MXFP4_qs 1u  // uint8_t qs[16]
#define HZ_MXFP4_TABLE_KVALUES hz_kvalues_mxfp4  // 16 int8 entries, (16,)
#if defined(HZ_FMT_MXFP4) || defined(HZ_ALL_TABLES)
const int hz_kvalues_mxfp4[16] = int[](0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
#endif

// NVFP4: ggml type 40, 64 values in 36 bytes, 16 values per scale group, dotted with q8_0
#define HZ_NVFP4_TYPE_ID 40
#define HZ_NVFP4_QK 64u
#define HZ_NVFP4_TS 36u
#define HZ_NVFP4_GROUP_LEN 16u
#define HZ_NVFP4_d 0u  // uint8_t d[4]
#define HZ_NVFP4_qs 4u  // uint8_t qs[32]
#define HZ_NVFP4_TABLE_KVALUES hz_kvalues_nvfp4  // 16 int8 entries, (16,)
#if defined(HZ_FMT_NVFP4) || defined(HZ_ALL_TABLES)
const int hz_kvalues_nvfp4[16] = int[](0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
#endif

// Q1_0: ggml type 41, 128 values in 18 bytes, 128 values per scale group, dotted with q8_0
#define HZ_Q1_0_TYPE_ID 41
#define HZ_Q1_0_QK 128u
#define HZ_Q1_0_TS 18u
#define HZ_Q1_0_GROUP_LEN 128u
#define HZ_Q1_0_d 0u  // ggml_half d
#define HZ_Q1_0_qs 2u  // uint8_t qs[16]

#endif  // HZ_GGML_BLOCKS_GLSL
