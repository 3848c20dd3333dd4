// Constants shared with the host code, GENERATED from hanzo_torch/constants.py (format facts from
// the format registry) by `python -m hanzo_torch.formats.codegen`: edit that module, not this
// file. tests/test_formats_codegen.py fails when the two differ.
#ifndef HZ_CONSTANTS_GLSL
#define HZ_CONSTANTS_GLSL

#define HZ_Q8_0_BLOCK 32u  // values per ggml block_q8_0 (q8_0 KV cache rows)
#define HZ_Q8_0_BYTES 34u  // bytes per ggml block_q8_0 (fp16 d, int8 qs[32])
#define HZ_Q8_1_BLOCK 32u  // values per ggml block_q8_1 (int8 dot-product activations)
#define HZ_Q8_1_BYTES 36u  // bytes per ggml block_q8_1 (fp16 d, fp16 s, int8 qs[32])
#define HZ_CPU_MATVEC_MAX_ROWS 5u  // CPU mul_mat: mat-vec kernel up to this many rows, GEMM above
#define HZ_VK_MATVEC_MAX_ROWS 8u  // Vulkan mul_mat: mat-vec shaders up to this many rows, GEMM above

// Bytes of one q8_0 KV cache row of D values (D a multiple of HZ_Q8_0_BLOCK).
#define HZ_Q8_0_ROW_BYTES(D) ((D) / HZ_Q8_0_BLOCK * HZ_Q8_0_BYTES)

#endif  // HZ_CONSTANTS_GLSL
