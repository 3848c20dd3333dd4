// Constants shared by the C++ of the CPU and Vulkan backends, GENERATED from hanzo_torch/constants.py
// (format facts from the format registry) by `python -m hanzo_torch.formats.codegen`: edit that
// module, not this file. tests/test_formats_codegen.py fails when the two differ.
#pragma once
#include <stdint.h>

#define HZ_Q8_0_BLOCK 32  // values per ggml block_q8_0 (q8_0 KV cache rows)
#define HZ_Q8_0_BYTES 34  // bytes per ggml block_q8_0 (fp16 d, int8 qs[32])
#define HZ_Q8_1_BLOCK 32  // values per ggml block_q8_1 (int8 dot-product activations)
#define HZ_Q8_1_BYTES 36  // bytes per ggml block_q8_1 (fp16 d, fp16 s, int8 qs[32])
#define HZ_CPU_MATVEC_MAX_ROWS 5  // CPU mul_mat: mat-vec kernel up to this many rows, GEMM above
#define HZ_VK_MATVEC_MAX_ROWS 8  // Vulkan mul_mat: mat-vec shaders up to this many rows, GEMM above

// Bytes of one q8_0 KV cache row of D values (D a multiple of HZ_Q8_0_BLOCK).
static inline int64_t hz_q8_0_row_bytes(int64_t D) { return D / HZ_Q8_0_BLOCK * HZ_Q8_0_BYTES; }
