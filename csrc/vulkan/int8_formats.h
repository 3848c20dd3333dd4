// Generated from hanzo_torch/backends/vulkan/rules.py (python -m hanzo_torch.backends.vulkan.rules);
// do not edit. The formats of the int8 contraction shaders (mul_mat_q8, mul_mat_vec_q8).
#pragma once

#define HZ_VK_INT8_FORMATS "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"
