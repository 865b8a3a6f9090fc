"""What the benchmarks share and none of them is: components composed from conf/, fixed-width
tables, median timing. A package, so ``python -m harness.bench`` lists none of it."""
