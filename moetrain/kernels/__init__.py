"""Kernels with plain-torch reference twins: FP8 / MXFP8 quantization (`quant`, `quant_triton`)."""
