"""The machine under the harness: the BLAS MLX links, model loading, what a run ran on."""
