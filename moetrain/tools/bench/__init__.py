"""Benchmarks: time full training steps of moetrain and of peers on the same GPU, same config."""
