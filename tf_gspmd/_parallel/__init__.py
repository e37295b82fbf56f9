"""The pipeline entry points: gs.pipeline (SPMD), gs.mpmd_pipeline and its stages, gs.plan_stages,
gs.auto_parallel."""
