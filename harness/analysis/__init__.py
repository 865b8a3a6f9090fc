"""Results and their analysis: the metrics, a run's files, the vLLM bench view,
compare and report."""
