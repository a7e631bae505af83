"""Kernel tests run the Triton kernels on the CPU through Triton's interpreter.

``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is decorated, i.e. when its
module is imported, so it must be set before any test module here imports one. The
interpreter runs programs one at a time on numpy and has no bfloat16 arithmetic:
tests use float32 (and float16) and small shapes.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
