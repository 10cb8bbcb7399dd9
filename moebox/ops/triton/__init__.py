"""Triton kernels for the GPU fast path (issue D), one module each. Importing this package never needs Triton:
each module imports it lazily or guards on it, and falls back to the torch reference off CUDA. Nothing is imported
here, so that `python -m moebox.ops.triton.<module>` runs a module that no package import loaded first."""
