"""Test setup: with no GPU, Triton kernels run in the interpreter (set before triton is imported)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
