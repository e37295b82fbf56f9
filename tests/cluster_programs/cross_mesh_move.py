"""Cross-mesh moves between processes (2 processes x 4 logical CPUs), run by every process.

Prints one JSON line per process: for each case, whether this process's destination shards hold the value's
slices, the bytes each of its destination devices received next to its slice's bytes, and the bytes that
crossed processes (sent or received by this process) next to those the case's slices need from the other
process.
"""

import json

import numpy as np


def cases(gs):
  P = gs.P
  worker = lambda k, i: f"/job:worker/replica:0/task:{k}/device:CPU:{i}"  # noqa: E731
  p0, p1 = [worker(0, i) for i in range(4)], [worker(1, i) for i in range(4)]
  return [   # (name, shape, dtype, source mesh, source spec, destination mesh, destination spec)
      ("p0_to_p1_uneven", (7, 5), np.float32, gs.Mesh((2, 2), ("a", "b"), devices=p0), P("a", None),
       gs.Mesh((4,), ("c",), devices=p1), P(None, "c")),
      ("both_to_both", (8, 12), np.int32, gs.Mesh((2, 4), ("x", "y"), devices=p0 + p1), P("x", "y"),
       gs.Mesh((2, 2), ("b", "a"), devices=p0[2:] + p1[:2]), P("a", "b")),
      ("replicated_stays_in_process", (6, 4), np.float32, gs.Mesh((8,), ("x",), devices=p0 + p1), P(),
       gs.Mesh((2,), ("y",), devices=p1[2:]), P("y", None)),
      ("p1_to_p0_3d", (3, 4, 5), np.float32, gs.Mesh((2, 2), ("a", "b"), devices=p1), P("b", None, "a"),
       gs.Mesh((1, 4), ("u", "v"), devices=p0), P(None, "v", None)),
  ]


def source(gs, x, mesh, spec):
  """The value laid out as `spec` over `mesh`: this process's tiles, or `value_elsewhere` when it holds none."""
  local = gs.local_devices(mesh) if any(gs.is_local(d) for d in mesh.devices) else ()
  if not local:
    return gs.value_elsewhere(x.shape, x.dtype, mesh, spec)
  s = gs.Sharding.from_spec(mesh, spec, rank=x.ndim)
  positions = [p for p, d in enumerate(mesh.devices) if d in local]
  lo = [min(s.tile_index(p, d) for p in positions) * s.shard_shape(x.shape)[d] for d in range(x.ndim)]
  hi = [min((max(s.tile_index(p, d) for p in positions) + 1) * s.shard_shape(x.shape)[d], x.shape[d])
        for d in range(x.ndim)]
  return gs.from_process_local_data(x[tuple(slice(a, b) for a, b in zip(lo, hi))], mesh, spec, x.shape)


def main():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_gspmd as gs  # pylint: disable=g-import-not-at-top
  k, _ = gs.initialize(cpu_devices=8)
  out = {"process": k}
  for name, shape, dtype, a, sa, b, sb in cases(gs):
    x = np.arange(int(np.prod(shape))).reshape(shape).astype(dtype)
    log = gs.TransferLog()
    y = gs.reshard(source(gs, x, a, sa), b, sb, log)
    received = log.bytes_received()
    shards = gs.shards_of(y)
    crossing = sum(t.bytes for t in log.transfers if gs.is_local(t.src_device) != gs.is_local(t.dst_device))
    # what the slices need from the other process: the same plan, read without moving anything
    plan = gs.plan_transfer(shape, tf.as_dtype(dtype), gs.Sharding.from_spec(a, sa, rank=len(shape)),
                            gs.Sharding.from_spec(b, sb, rank=len(shape)), a.devices, b.devices)
    need = sum(t.bytes for q in plan for t in plan[q] if gs.is_local(t.src_device) != gs.is_local(t.dst_device))
    out[name] = {
        "values": all(np.array_equal(s.numpy(), x[s.index]) for s in shards),
        "shards": len(shards),
        "received": [[received.get(s.device, 0), int(np.prod(s.shape)) * x.itemsize] for s in shards],
        "crossing": crossing, "need": need,
        "whole_value_bytes": x.nbytes,
    }
  print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
  main()
