"""Graph passes that turn an annotated global TF graph into one per-device SPMD program."""
