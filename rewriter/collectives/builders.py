"""The one module that builds collective ops (each through its entry in the collectives vocabulary,
rewriter/collectives/vocabulary.py). CPU, GPU, TPU and multi-worker differ only here.

Groups are sets of mesh devices that differ only along some mesh axes (rewriter/collectives/groups.py). Every
device runs the same program, so per-device values (group key, permutation) are read from constant tables indexed
by the partition id. Group keys derive from the member device names (the same in every process); instance keys
come from one process-wide counter, so every program gets fresh, deterministic keys. No collective hangs:
the runtime aborts a program's collectives past its deadline (DeadlineExceededError). The ops' own
`timeout_seconds` stays 0 on purpose: TF starts a timer thread per collective per device for it.

Widths: each tensor travels at its own width where TF's op takes its dtype, else bitcast or packed into one it
takes (rewriter/collectives/widths.py).

Across processes: where every group of a collective joins several processes with the same number L > 1 of its
members in each, the collective is built in two levels, so that the network between processes carries 1/L of
what a flat collective would (what XLA and NCCL call hierarchical collectives). An all-reduce is a
reduce-scatter among the group's members within each process (an all-to-all of L slices and a local
reduction), an all-reduce of one slice across processes among the members of one local rank, and an all-gather
within each process; an all-gather gathers across processes first (each member its own shard), then within; a
reduce-scatter reduces within each process first (each member the partial sums of the chunks its peers of its
local rank keep), then across. Flat sizes that L does not divide are padded. All-to-alls and permutes stay flat
(their data leaves the process once either way).
"""

import math

import numpy as np
import tensorflow as tf

from tf_gspmd.errors import PartitionError
from tf_gspmd.rewriter.collectives import vocabulary
from tf_gspmd.rewriter.collectives.groups import MeshGroups, group_key, next_instance_key
from tf_gspmd.rewriter.report import CollectiveRecord, Emitted
from tf_gspmd.rewriter.collectives.widths import (WIDER, from_carrier, moving, moving_note, scalar, summing,
                                                  summing_note, to_carrier)


_REDUCE = {"Add": tf.reduce_sum, "Max": tf.reduce_max, "Min": tf.reduce_min, "Mul": tf.reduce_prod}


def communication_hint(devices):
  """How TF's collectives among `devices` communicate: "nccl" among GPUs that are each a physical GPU (XLA then
  compiles their summing all-reduces, as NCCL's: rewriter/backend/jit.py), "ring" among logical GPUs that share
  one (NCCL takes one physical GPU per member), else "auto" (TF's own choice: its ring on CPUs)."""
  if (tf.DeviceSpec.from_string(devices[0]).device_type or "CPU").upper() != "GPU":
    return "auto"
  if len(tf.config.list_logical_devices("GPU")) > len(tf.config.list_physical_devices("GPU")):
    return "ring"
  return "nccl"


def _token_pairs(idle, starved):
  """{sender: receiver} of tokens: a bijection from the members that send nothing (`idle`) to those that receive
  nothing (`starved`, as many), none to itself; None when there is none (a single member that is both)."""
  k = len(starved)
  for r in range(k):   # unless idle == starved == [p], some rotation pairs no member with itself
    if all(idle[(i + r) % k] != starved[i] for i in range(k)):
      return {idle[(i + r) % k]: starved[i] for i in range(k)}
  return {} if not k else None


class Backend(MeshGroups):
  """Emits collectives over mesh axes (their groups: `MeshGroups`) into the per-device graph being built."""

  def __init__(self, mesh, devices, pid, lookup, report, processes=None):
    super().__init__(mesh, devices, processes)
    self.emitted = {}         # op name -> Emitted, for every collective op built here
    self.pid = pid
    self.lookup = lookup      # lookup(np table, name) -> per-device row of the table (a tensor)
    self.report = report
    self.hint = communication_hint(self.devices)

  def _keys(self, axes, level=None):
    of, members = self._groups_at(axes, level)
    keys = np.array([group_key([self.devices[p] for p in m]) for m in members], np.int32)
    size = len(members[0])
    return size, self.lookup(keys[of], f"group_key_{'_'.join(axes)}{f'_{level}' if level else ''}")

  def _rank_permutation(self, axes):
    """Per-position permutation from runtime rank order to mesh order, or None when they agree."""
    of, members = self.groups(axes)
    ranked = self.ranked_groups(axes).members
    perms = [[r.index(p) for p in m] for m, r in zip(members, ranked)]
    if all(p == sorted(p) for p in perms):
      return None
    return np.array(perms, np.int32)[of]

  def _describe(self, out, kind, axes, carried, group_size, reduction=None, gathered=False, sends=True,
                device_bytes=None, shape=None, level=None, who=(None, None, None)):
    """Record the op producing `out` in `self.emitted`, from the tensor it carries (`shape`: its largest, where
    it differs by device; `device_bytes`: what each device sends through the op, where devices differ; nothing
    for a receive); returns the description."""
    shape = [int(d) for d in (carried.shape if shape is None else shape)]
    if gathered:
      shape[0] *= group_size
    nbytes = math.prod(shape) * carried.dtype.size if sends and group_size > 1 else 0
    if device_bytes is not None:
      nbytes = int(np.max(device_bytes))
      device_bytes = tuple(int(b) for b in device_bytes)
    crosses = self._crosses_processes(axes) if level is None else level == "across"
    groups, instance, partner = who   # (Groups, instance key, a receive's send op)
    e = Emitted(kind, tuple(axes), reduction, out.op.name, out.op.type, carried.dtype.name, tuple(shape), group_size,
                nbytes, device_bytes, crosses, level, groups=groups, instance_key=instance, partner=partner)
    self.emitted[e.name] = e
    return e

  # ---- the ops ------------------------------------------------------------------------------------------------
  def _emit(self, kind, y, axes, reduction=None, name=None, level=None):
    """The TF op of `kind` on `y` (a dtype the op takes) over the groups of `axes` (or of their `level`: "within"
    each process or "across" processes, see `levels`), recorded in `self.emitted`.

    Returns (its result with a static shape, its Emitted). An all-reduce merges `y` with `reduction`; an
    all-gather concatenates every member's `y` along dim 0 and an all-to-all sends row block k of `y` (dim 0
    cut into group-size blocks) to the member of runtime rank k, both in *runtime rank* order (the callers
    put it in mesh order where the two differ).
    """
    size, key = self._keys(axes, level)
    instance = next_instance_key()
    common = dict(input=y, group_size=size, group_key=key, instance_key=instance, ordering_token=[],
                  communication_hint=self.hint, name=name or kind.replace("-", "_"))
    build = vocabulary.BY_KIND[kind].build
    who = (self.ranked_groups(axes, level), instance, None)
    if kind == "all-reduce":
      out = build(**common, merge_op=reduction, final_op="Id")
      return out, self._describe(out, kind, axes, y, size, reduction=reduction, level=level, who=who)
    if kind == "all-gather":
      out = build(**common)
      e = self._describe(out, kind, axes, y, size, gathered=True, level=level, who=who)
      return tf.reshape(out, [size * y.shape[0]] + y.shape.as_list()[1:]), e   # the op leaves dim 0 unknown
    if kind == "all-to-all":
      out = build(**common)
      return tf.reshape(out, y.shape), self._describe(out, kind, axes, y, size, level=level, who=who)
    raise ValueError(f"no collective op of kind {kind!r}")

  def combined(self, kind, operands, axes, reduction=None, level=None):
    """One op of `kind` over the groups of `axes` that does the work of several ops of that kind (the combine pass).

    `operands` are the tensors the ops were given (one dtype, static shapes); the result has, per operand, what its
    own op returned, exactly: each device sends its operands flattened side by side, so the op moves their bytes
    and no more. An all-reduce sums [total]; an all-gather gathers [total] into [group, total], whose columns
    per operand, reshaped to [group * rows, ...], are what gathering that operand's rows gives; an all-to-all
    exchanges [group, total], whose row k is every operand's row block k (dim 0 of an all-to-all's operand is
    cut into group-size blocks), so what arrives from each member splits the same way. The collective is not
    recorded in the report (its members' records are pointed at it). `level`: the members' level (see `levels`).
    Returns ([per operand], its Emitted).
    """
    size = len(self._groups_at(axes, level)[1][0])
    if kind == "all-to-all":
      if any(x.shape[0] != size for x in operands):
        raise ValueError(f"an all-to-all's operand must have {size} rows (the group size) to be combined")
      y = tf.concat([tf.reshape(x, [size, -1]) for x in operands], 1)
    else:
      y = tf.concat([tf.reshape(x, [-1]) for x in operands], 0)
    out, e = self._emit(kind, y, axes, reduction=reduction, level=level)
    widths = [x.shape.num_elements() // (size if kind == "all-to-all" else 1) for x in operands]
    if kind == "all-reduce":
      return [tf.reshape(p, x.shape) for x, p in zip(operands, tf.split(out, widths))], e
    parts = tf.split(tf.reshape(out, [size, -1]), widths, axis=1)
    if kind == "all-gather":
      return [tf.reshape(p, [size * x.shape[0]] + x.shape.as_list()[1:]) for x, p in zip(operands, parts)], e
    return [tf.reshape(p, x.shape) for x, p in zip(operands, parts)], e

  # ---- collectives ----------------------------------------------------------------------------------------
  def alone(self, axes):
    """Whether every group of `axes` has one member (its axes have size 1): a collective over it is its operand,
    so none is emitted (as XLA drops an all-reduce of one replica)."""
    return self.group_size(axes) == 1

  def all_reduce(self, x, axes, op, source, reason):
    if self.alone(axes):
      return x
    carrier, how = summing(x.dtype, op, source)
    y = tf.bitcast(x, carrier) if how == "bitcast" else tf.cast(x, carrier) if how else x
    levels = self.levels(axes)
    if levels is None:
      out, e = self._emit("all-reduce", y, axes, reduction=op)
      ops, note = (e,), ""
    else:
      out, ops, note = self._all_reduce_in_levels(y, axes, op, levels, source)
    self._record("all-reduce", x, x.shape, self.group_size(axes), axes, source, reason, ops,
                 "; ".join(filter(None, [summing_note(x.dtype, carrier, how), note])))
    return tf.bitcast(out, x.dtype) if how == "bitcast" else tf.cast(out, x.dtype) if how else out

  def _all_reduce_in_levels(self, y, axes, op, levels, source):
    """All-reduce `y` (a dtype CollectiveReduceV2 takes) in two levels: each member reduces 1/L of it within its
    process, all-reduces that slice across processes with its peers of the same local rank, and the slices are
    gathered within the process again. Returns (result, the ops, note)."""
    n, per_process = y.shape.num_elements(), levels.per_process
    c = -(-n // per_process)
    flat = tf.reshape(y, [-1])
    if c * per_process != n:   # padding: reduced and dropped
      flat = tf.pad(flat, [[0, c * per_process - n]])
    got, scatter, _ = self._exchange_rows(tf.reshape(flat, [per_process, c]), axes, "within", source,
                                          "all_reduce_within")
    part, reduce = self._emit("all-reduce", _REDUCE[op](got, axis=0), axes, reduction=op, name="all_reduce_across",
                              level="across")
    full, gather, _ = self._gather_rows(part, axes, "within", source, "all_reduce_gather_within")
    if c * per_process != n:
      full = full[:n]
    return tf.reshape(full, y.shape), (scatter, reduce, gather), levels.note("all-reduce")

  def _gather_rows(self, y, axes, level, source, name="all_gather"):
    """Every member's `y` concatenated along dim 0, in runtime rank order of the groups of `axes` (or of their
    `level`), in any dtype the gather can move. Returns (result, its Emitted, note)."""
    shape = y.shape.as_list()
    carrier, per = moving(y.dtype, "CollectiveGatherV2", source)
    z = to_carrier(y[None] if per > 1 else y, carrier, per, 1)   # packed: each member's rows are one row
    g, e = self._emit("all-gather", z, axes, name=name, level=level)
    gathered = [e.group_size * shape[0]] + shape[1:]
    g = tf.reshape(from_carrier(g, y.dtype, per, [math.prod(shape)]), gathered)
    return g, e, moving_note(y.dtype, carrier, per, "CollectiveGatherV2")

  def _exchange_rows(self, parts, axes, level, source, name):
    """Row r of `parts` (one row per member) sent to the member of runtime rank r of the groups of `axes` (or of
    their `level`); returns (what arrived, row r from rank r; its Emitted; note)."""
    carrier, per = moving(parts.dtype, "CollectiveAllToAllV2", source)
    got, e = self._emit("all-to-all", to_carrier(parts, carrier, per, 1), axes, name=name, level=level)
    return (from_carrier(got, parts.dtype, per, parts.shape.as_list()[1:]), e,
            moving_note(parts.dtype, carrier, per, "CollectiveAllToAllV2"))

  def all_gather(self, x, dim, axes, source, reason):
    """Concatenate the shards of the group along `dim`, in mesh order."""
    if self.alone(axes):
      return x
    rank = x.shape.rank
    perm = [dim] + [d for d in range(rank) if d != dim]
    y = tf.transpose(x, perm) if dim else x
    shape = y.shape.as_list()
    size = self.group_size(axes)
    gathered = [size * shape[0]] + shape[1:]
    tag = "_".join(axes)
    levels = self.levels(axes)
    if levels is None:
      g, e, note = self._gather_rows(y, axes, None, source)
      ops, order, name = (e,), self._rank_permutation(axes), f"rank_perm_{tag}"
    else:   # each member's shard across processes first, then those within the process: block (j, q)
      g, across, note = self._gather_rows(y, axes, "across", source, "all_gather_across")
      g, within, _ = self._gather_rows(g, axes, "within", source, "all_gather_within")
      ops, order, name = (across, within), np.argsort(levels.order, axis=1).astype(np.int32), f"levels_order_{tag}"
      note = "; ".join(filter(None, [levels.note("all-gather"), note]))
    if order is not None:   # back to mesh order
      chunks = tf.reshape(g, [size, -1])
      g = tf.reshape(tf.gather(chunks, self.lookup(order, name)), gathered)
    if dim:
      g = tf.transpose(g, np.argsort(perm))
    self._record("all-gather", x, g.shape, size, axes, source, reason, ops, note)
    return g

  def _chunks(self, x, dim, axes):
    """Dim `dim` of x cut into group-size chunks, chunk first: [chunk, .., c, ..] in mesh order."""
    size = self.group_size(axes)
    shape = x.shape.as_list()
    # [.., dim, ..] -> [chunk, .., c, ..]: TF's CPU all-to-all exchanges slices of dim 0.
    parts = tf.reshape(x, shape[:dim] + [size, shape[dim] // size] + shape[dim + 1:])
    return tf.transpose(parts, [dim] + [d for d in range(len(shape) + 1) if d != dim])

  def _exchange_chunks(self, x, dim, axes, name, source):
    """Cut dim `dim` of x into group-size chunks and send chunk k to the k-th member (mesh order).

    Returns ([sender, ..., chunk, ...]: what arrived, in the senders' mesh order, the op's description, note).
    """
    parts = self._chunks(x, dim, axes)
    rank_perm = self._rank_permutation(axes)
    tag = "_".join(axes)
    if rank_perm is not None:   # slot r must carry the chunk of the member with runtime rank r
      parts = tf.gather(parts, self.lookup(np.argsort(rank_perm, axis=1).astype(np.int32), f"rank_inv_{tag}"))
    got, e, note = self._exchange_rows(parts, axes, None, source, name)
    if rank_perm is not None:   # slot r came from rank r: back to the senders' mesh order
      got = tf.gather(got, self.lookup(rank_perm, f"rank_perm_{tag}"))
    return got, e, note

  def all_to_all(self, x, src, dst, axes, source, reason):
    """Move a split from dim `src` to dim `dst` over the group of `axes`.

    Dim `dst` is cut into group-size chunks; chunk k goes to the k-th member (mesh order); what arrives is
    concatenated along `src` in the senders' mesh order.
    """
    if self.alone(axes):
      return x
    shape = x.shape.as_list()
    rank = len(shape)
    got, e, note = self._exchange_chunks(x, dst, axes, "all_to_all", source)
    size = got.shape[0]
    # [sender, .., src, ..] -> [.., sender * src, ..]: the sender index is the major part of `src`.
    got = tf.transpose(got, list(range(1, src + 1)) + [0] + list(range(src + 1, rank + 1)))
    out_shape = shape[:dst] + [shape[dst] // size] + shape[dst + 1:]
    out_shape[src] *= size
    self._record("all-to-all", x, x.shape, size, axes, source, reason, (e,), note)
    return tf.reshape(got, out_shape)

  def reduce_scatter(self, x, dim, axes, op, source, reason):
    """Sum (or max/min/product) partial results over the group, each member keeping its chunk of `dim`.

    TF's CollectiveReduceScatterV2 has no CPU kernel: emitted as an all-to-all of the chunks (member k
    receives everyone's chunk k, at the dtype's own width) and a local reduction (in a wider dtype where an
    all-reduce would carry one), which moves no more than a reduce-scatter. Across processes (see `levels`), in
    two such steps: within each process, member j receives the chunks of its peers of local rank j in every
    process (their partial sums over the process), then across processes each receives its own chunk's.
    """
    if self.alone(axes):
      return x
    wide = WIDER.get(x.dtype, x.dtype)

    def reduce(got):
      return tf.cast(_REDUCE[op](tf.cast(got, wide), axis=0), x.dtype)

    levels = self.levels(axes)
    if levels is None:
      got, e, note = self._exchange_chunks(x, dim, axes, "reduce_scatter", source)
      ops, note = (e,), "; ".join(filter(None, ["all-to-all + local reduction", note]))
      out = reduce(got)
    else:
      parts = self._chunks(x, dim, axes)
      parts = tf.gather(parts, self.lookup(levels.order, f"levels_slots_{'_'.join(axes)}"))   # slot (j, q)
      parts = tf.reshape(parts, [levels.per_process, levels.processes] + parts.shape.as_list()[1:])
      got, within, note = self._exchange_rows(parts, axes, "within", source, "reduce_scatter_within")
      got, across, _ = self._exchange_rows(reduce(got), axes, "across", source, "reduce_scatter_across")
      ops = (within, across)
      note = "; ".join(filter(None, [levels.note("reduce-scatter"), "all-to-alls + local reductions", note]))
      out = reduce(got)
    self._record("reduce-scatter", x, x.shape, self.group_size(axes), axes, source, reason, ops, note)
    return out

  def collective_permute(self, x, axes, pairs=None, shift=None, cyclic=False, fill=0, source="", reason=""):
    """Within every group of `axes`, each member sends `x` to at most one member and receives from at most one.

    Args:
      x: the local tensor every device sends.
      axes: mesh axes whose groups the permute runs in; members are numbered in mesh order along them.
      pairs: (sender, receiver) member numbers, each sender and each receiver at most once; or
      shift: member k sends to member k + shift (modulo the group size when `cyclic`, else none past the ends).
      fill: what a member that receives nothing gets (selected, so no received value leaks into it).
      source, reason: for the report.
    Returns:
      What this device received, shaped like `x` (its own `x` where it sends to itself).

    Each transfer is a broadcast in a group of its two devices (`CollectiveBcastSendV2`/`RecvV2`, one group
    key per ordered pair, read from per-device tables), so the data goes to one peer only. Every device runs one
    send and one receive, with no control edge between them, so no cycle of transfers can block. TF has no
    lone send or receive, so the members without a receiver send, each to a member without a sender, a
    one-element token instead of their data (the sent tensor's size is per device); what a token's receiver
    gets is `fill`. A permute that leaves exactly one member without a peer has no one to pair it with and
    is refused.
    """
    _, members = self.groups(axes)
    size = len(members[0])
    pairs = self._permute_pairs(pairs, shift, cyclic, size, source)
    if size == 1:   # nothing to move: a member sends to itself or to no one
      return x if pairs else tf.fill(x.shape, scalar(fill, x.dtype))
    moves = {a: b for a, b in pairs if a != b}
    idle = [k for k in range(size) if k not in moves]
    starved = [k for k in range(size) if k not in moves.values()]
    tokens = _token_pairs(idle, starved)
    if tokens is None:
      raise PartitionError(f"collective-permute pairs {pairs} over a group of {size} leave only member {idle[0]} "
                           "without a peer: TF's broadcasts have no lone send or receive to give it", node=source)
    carrier, per = moving(x.dtype, "CollectiveBcastSendV2", source)
    y = to_carrier(x, carrier, per, 0)
    send_key, recv_key, count, receives, keeps = self._permute_tables(members, pairs, moves, tokens,
                                                                      math.prod(y.shape.as_list()))
    got, ops = self._permute_transfers(y, axes, tokens, send_key, recv_key, count, receives,
                                       self.transfer_groups(axes, {**moves, **tokens}))
    tag = "_".join(axes)
    z = from_carrier(got, x.dtype, per, x.shape.as_list())
    if not receives.all():
      z = tf.where(self.lookup(receives, f"permute_receives_{tag}"), z, scalar(fill, x.dtype))
    if keeps.any():
      z = tf.where(self.lookup(keeps, f"permute_keeps_{tag}"), x, z)
    note = moving_note(x.dtype, carrier, per, "CollectiveBcastSendV2")
    if tokens:
      note = "; ".join(filter(None, [note, "members without a receiver send a one-element token to those without a "
                                            "sender (TF has no lone send or receive)"]))
    self._record("collective-permute", x, x.shape, size, axes, source, reason, ops, note)
    return z

  @staticmethod
  def _permute_pairs(pairs, shift, cyclic, size, source):
    """A collective-permute's (sender, receiver) pairs as given or from its `shift`; PartitionError unless each
    member of the group of `size` sends at most once and receives at most once."""
    if pairs is None:
      pairs = [(k, k + shift) for k in range(size)]
      pairs = [(a, b % size) for a, b in pairs] if cyclic else [(a, b) for a, b in pairs if 0 <= b < size]
    pairs = [(int(a), int(b)) for a, b in pairs]
    to, frm = dict(pairs), {b: a for a, b in pairs}
    if len(to) != len(pairs) or len(frm) != len(pairs) or not all(0 <= k < size for p in pairs for k in p):
      raise PartitionError(f"collective-permute pairs {pairs} over a group of {size}: each member may send once and "
                           "receive once", node=source)
    return pairs

  def _permute_tables(self, members, pairs, moves, tokens, elements):
    """A collective-permute's per-device tables (indexed by mesh position): (group key of its send, group key of its
    receive, elements it sends (1: a token), whether it receives data, whether it keeps its own `x`).

    `moves` and `tokens` are {sender: receiver} of the data and of the tokens, member numbers of every group.
    """
    to = dict(pairs)
    n = self.mesh.size
    send_key, recv_key, count = np.zeros(n, np.int32), np.zeros(n, np.int32), np.ones(n, np.int32)
    receives, keeps = np.zeros(n, np.bool_), np.zeros(n, np.bool_)
    peer = {**moves, **tokens}   # every member sends once and receives once
    sender_of = {b: a for a, b in peer.items()}
    for m in members:
      names = [self.devices[p] for p in m]
      for k, p in enumerate(m):
        send_key[p] = group_key([names[k], names[peer[k]]])
        recv_key[p] = group_key([names[sender_of[k]], names[k]])
        count[p] = elements if k in moves else 1
        receives[p], keeps[p] = sender_of[k] in moves, to.get(k) == k
    return send_key, recv_key, count, receives, keeps

  def _permute_transfers(self, y, axes, tokens, send_key, recv_key, count, receives, groups):
    """Every device's one send and one receive of a collective-permute of `y` (see `_permute_tables`).

    Returns (what this device received, shaped like `y`; the descriptions of its send and its receive).
    """
    shape = y.shape.as_list()
    elements = math.prod(shape)
    n = self.mesh.size
    tag = "_".join(axes)
    if tokens:   # a token is the first element of the flattened data; the receiver pads it back out
      sending = tf.slice(tf.reshape(y, [-1]), [0], self.lookup(count[:, None], f"permute_count_{tag}"))
      recv_shape = self.lookup(np.where(receives, elements, 1).astype(np.int32)[:, None],
                               f"permute_recv_count_{tag}")
      carried = [elements]
    else:
      sending, recv_shape, carried = y, shape, shape
    instance = next_instance_key()
    sent = vocabulary.PERMUTE_SEND.build(input=sending, group_size=2, group_key=self.lookup(
        send_key, f"permute_send_key_{tag}"), instance_key=instance, communication_hint=self.hint,
        name="permute_send")
    got = vocabulary.PERMUTE_RECEIVE.build(group_size=2, group_key=self.lookup(recv_key, f"permute_recv_key_{tag}"),
                                           instance_key=instance, shape=recv_shape, T=y.dtype,
                                           communication_hint=self.hint, name="permute_recv")
    per_device = count * y.dtype.size
    ops = (self._describe(sent, "collective-permute", axes, y, 2, device_bytes=per_device if tokens else None,
                          shape=carried, who=(groups[0], instance, None)),
           self._describe(got, "collective-permute", axes, y, 2, sends=False, shape=carried,
                          who=(groups[1], instance, sent.op.name)))
    with tf.control_dependencies([sent.op]):   # the send stays in the program; only the result waits for it
      got = tf.identity(got)
    if tokens:
      missing = np.zeros((n, 1, 2), np.int32)
      missing[~receives, 0, 1] = elements - 1
      got = tf.reshape(tf.pad(got, self.lookup(missing, f"permute_token_pad_{tag}")), shape)
    return got, ops

  def halo_exchange(self, x, dim, axes, left, right, source, reason):
    """x extended along `dim` by the last `left` rows of the previous member's shard and the first `right` rows
    of the next member's (zeros at the ends of the group): two collective-permutes, each moving only its halo."""
    n = x.shape[dim]
    rank = x.shape.rank

    def rows(start, count):
      begin = [0] * rank
      extent = [-1] * rank
      begin[dim], extent[dim] = start, count
      return tf.slice(x, begin, extent)

    parts = [x]
    if left:
      parts.insert(0, self.collective_permute(rows(n - left, left), axes, shift=1, source=source,
                                              reason=f"{reason} (previous shard's {left} edge row(s))"))
    if right:
      parts.append(self.collective_permute(rows(0, right), axes, shift=-1, source=source,
                                           reason=f"{reason} (next shard's {right} edge row(s))"))
    return tf.concat(parts, axis=dim)

  def _record(self, kind, x, shape, size, axes, source, reason, ops, note=""):
    shape = tuple(int(s) for s in shape)
    if any(s is None for s in shape):
      raise PartitionError(f"collective on a tensor of unknown shape {shape}", node=source)
    self.report.add(CollectiveRecord(kind, x.dtype.name, shape, math.prod(shape) * x.dtype.size, size, tuple(axes),
                                     source, reason, ops, note))
