"""Workloads: request traces, their files, and the
seeded generators and distributions that make them."""
