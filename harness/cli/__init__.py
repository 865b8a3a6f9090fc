"""The command line: kvbench's run and its config checks,
the trace replay, load sweeps, the regression check."""
