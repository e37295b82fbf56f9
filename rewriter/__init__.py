"""Graph passes that turn an annotated global TF graph into one per-device SPMD program.

The rooms, by phase (docs/architecture.md draws them): graph/ (GraphDef reading and editing, no shardings),
program.py and report.py (the records of a lowering), frontend/ (tracing, Grappler, annotations), collectives/
(the vocabulary, groups and builders of TF's collective ops, combining, ordering), sharding/ (completion,
weight-update sharding, resharding, memory, automatic sharding), stages/ (inter-operator planning), partition/
(partitioning), one_graph/ (a process's CPUs as one graph), backend/ (per-device clean-up, XLA), and pipeline.py
(the passes and the paths through them).
"""
