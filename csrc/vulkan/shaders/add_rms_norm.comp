#version 450
// hanzo::add_rms_norm (body in norm.glsl)
#define FZ_ADD 1
#include "fused.glsl"
#include "norm.glsl"
