"""kvbench package: importing it first switches MLX's Linux CPU BLAS to MKL (see harness.blas)."""

from harness import blas

blas.configure()
