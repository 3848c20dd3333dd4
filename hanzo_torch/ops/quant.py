"""Placeholder for the quantized ops (mul_mat, ...)."""
