"""Test set-up: without a GPU every Triton kernel runs in the interpreter on CPU tensors.

TRITON_INTERPRET must be set before Triton defines a kernel, so it is set here, before any
pyprune kernel module is imported (pyprune imports them lazily).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
