"""The runtime: runs a lowered per-device program on the mesh devices and keeps sharded state between calls.

`executable` imports the program and runs it on every device concurrently, `state` stores captured variables
as one shard per device, `sharded_tensor` holds values laid out over the mesh. It reads only plain fields of
the lowered program and imports from `tf_gspmd.rewriter` only the collectives vocabulary, the one place the TF
collective ops it builds (cross-mesh transfers, gathers to the host) are named.
"""
