"""Shared test set-up."""

import harness  # noqa: F401  (first: switches MLX to MKL before any test imports mlx)
