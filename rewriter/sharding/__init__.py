"""Shardings: GSPMD's completion, weight-update sharding, the resharding planner, the memory a layout keeps, and
automatic sharding (auto/)."""
