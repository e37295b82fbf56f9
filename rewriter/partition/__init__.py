"""Partitioning: the per-device program emitted op by op, halos, pending sums, pipeline schedules."""
