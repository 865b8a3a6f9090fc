"""kvbench package: importing it first switches MLX's Linux CPU BLAS to MKL (see
harness.platform.blas)."""

from harness.platform import blas

blas.configure()
