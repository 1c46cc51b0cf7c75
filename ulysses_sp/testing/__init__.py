"""Test utilities: fakes that let code written for GPU-only libraries run on CPU tensors."""
