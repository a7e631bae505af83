"""Kernels of hybridserve: one file per kernel, its plain-PyTorch reference beside it.

The references are the CPU path of the model and the oracle of the Triton kernels
(tested on the CPU with ``TRITON_INTERPRET=1``). Installed as ``hybridserve.kernels``.
"""
