"""Placeholder: q8_1 activation quantization lands in a later commit."""
def quantize_q8_1(x):
    raise NotImplementedError
def dequantize_q8_1(x):
    raise NotImplementedError
