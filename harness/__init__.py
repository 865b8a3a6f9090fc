"""kvbench package: importing it first switches MLX's Linux CPU BLAS to MKL (see
harness.platform.blas), and keeps transformers' "PyTorch was not found" advice (it is imported
for tokenizers only, never for models) out of kvbench's output."""

import logging

from harness.platform import blas

blas.configure()
logging.getLogger("transformers").addFilter(
    lambda record: not record.getMessage().startswith("PyTorch was not found")
)
