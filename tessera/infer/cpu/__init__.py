"""The CPU kernels: one C++ library (csrc/, built at first use) behind three seams of the model,
attention over the paged cache read in place (attention.py), one-pass norms, rotary embedding and
SwiGLU (layer_ops.py) and projections on packed weight panels (linear.py); and freed activations kept
between steps (memory.py). Each steps aside for the PyTorch ops where it does not apply.
"""
