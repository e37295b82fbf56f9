"""XLA's own SPMD partitioner on TF-exported HLO, on host CPU devices: the XLA side of tools/xla_oracle.py.

Runs in the oracle's virtualenv (`make oracle-venv`: jax[cpu]==0.10.2, no TensorFlow), never in the project's:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv-oracle/bin/python tools/xla_partition.py DIR

DIR holds manifest.json ({"programs": [{"name", "devices", "loop_trips": {HLO op_name: trips}, "arg_shardings",
"result_shardings"}]}) and, per program, NAME.hlo.pb (the HloModuleProto TF exported) and NAME.inputs.npz (arr_0,
arr_1, ...: one array per entry parameter). For each program this converts the module to StableHLO, gives the entry
parameters and results the shardings the manifest lists (HLO sharding text), else those of the `Sharding`
custom-calls that consume / produce them (what TF's TPU bridge does), else replicated, compiles it for `devices` partitions with the GSPMD partitioner, runs it on inputs laid out that way,
and writes NAME.outputs.npz (the global results), NAME.after_spmd.hlo.txt (the module right after
`spmd-partitioning`, before CPU passes change its collectives) and NAME.result.json (the collectives of that
module, see `collectives`).

Bytes per device follow tf_gspmd's report (docs/inspecting.md "Reading a plan and a report"): the per-device result
of an all-gather, the per-device operand of all-reduce, all-to-all, collective-permute and reduce-scatter (its
result times the group size); a device in a group of one, or a permute's device that is no source, sends nothing. A
collective inside a while loop counts once per iteration: times the loop's trip count (its `known_trip_count`, else
the one the manifest gives for the loop's op_name; else once, and the loop is listed as unknown).
"""

import glob
import json
import math
import os
import re
import shutil
import sys
import traceback

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np  # noqa: E402

KINDS = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")
BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
         "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0}
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(.*?\)|[a-z]+\d*\[[\d,]*\](?:\{[^}]*\})?|token\[\])\s+"
                    r"([a-z\-]+)\((.*)$")
_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


# ---- reading the partitioned module --------------------------------------------------------------------------------

def arrays(type_text):
  """[(dtype, shape)] of an HLO type ("f32[8,16]{1,0}" or a tuple of them)."""
  return [(d, tuple(int(x) for x in s.split(",") if x)) for d, s in _ARRAY.findall(type_text)]


def nbytes(type_text):
  return sum(BYTES.get(d, 4) * math.prod(s) for d, s in arrays(type_text))


def computations(text):
  """{computation name: [instruction lines]} and the entry computation's name."""
  comps, entry, current = {}, None, None
  for line in text.splitlines():
    if current is None:
      m = _COMP.match(line)
      if m and not line.startswith("HloModule"):
        current = m.group(2)
        comps[current] = []
        if m.group(1):
          entry = current
    elif line.strip() == "}":
      current = None
    else:
      comps[current].append(line)
  return comps, entry


def groups_of(line, n):
  """The device groups of a collective instruction (replica_groups in any of XLA's spellings), [[0..n-1]] if
  it names none."""
  m = re.search(r"replica_groups=(\{(?:\{[\d,]*\},?)*\})", line)
  if m:
    found = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1)[1:-1])]
    return found or [list(range(n))]
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
  if m:
    dims = [int(x) for x in m.group(3).split(",")]
    perm = [int(x) for x in m.group(4).split(",")] if m.group(4) else list(range(len(dims)))
    ids = np.arange(math.prod(dims)).reshape(dims).transpose(perm).reshape(int(m.group(1)), int(m.group(2)))
    return ids.tolist()
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
  if m:
    axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
    names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
    inside = re.findall(r"'([^']+)'", m.group(2))
    if any(a not in names for a in inside):
      raise ValueError(f"cannot read replica groups of: {line.strip()[:200]}")
    order = [k for k, a in enumerate(names) if a not in inside] + [names.index(a) for a in inside]
    size = math.prod(sizes[names.index(a)] for a in inside)
    return np.arange(math.prod(sizes)).reshape(sizes).transpose(order).reshape(-1, size).tolist()
  if "replica_groups" in line:
    raise ValueError(f"cannot read replica groups of: {line.strip()[:200]}")
  return [list(range(n))]


def loop_multipliers(comps, entry, manifest_trips):
  """{computation: times it runs per run of the entry} through while loops (a condition runs trips + 1 times),
  and the loops whose trip count is not known (counted once)."""
  times, unknown = {entry: 1}, []
  stack = [entry]
  while stack:
    comp = stack.pop()
    for line in comps.get(comp, ()):
      m = _INSTR.match(line)
      if not m:
        continue
      calls = []
      if m.group(3) == "while":
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
        op = re.search(r'op_name="([^"]*)"', line)
        n = int(trips.group(1)) if trips else manifest_trips.get(op.group(1) if op else "")
        if n is None:
          unknown.append(op.group(1) if op else m.group(1))
          n = 1
        calls += [(c, n) for c in re.findall(r"body=%?([\w.\-]+)", line)]
        calls += [(c, n + 1) for c in re.findall(r"condition=%?([\w.\-]+)", line)]
      elif m.group(3) in ("call", "conditional", "async-start"):
        calls += [(c, 1) for c in re.findall(r"(?:to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)",
                                             line)]
        for branches in re.findall(r"branch_computations=\{([^}]*)\}", line):
          calls += [(c.strip().lstrip("%"), 1) for c in branches.split(",")]
      for c, k in calls:
        if c in comps and c not in times:
          times[c] = times[comp] * k
          stack.append(c)
  return times, unknown


def collectives(text, n, manifest_trips):
  """The collectives of a partitioned module: per instruction its kind, dtype, per-device shape (its result),
  groups (or source-target pairs), what each device sends through it (bytes, tf_gspmd's convention), the times it
  runs per step, its op_name."""
  comps, entry = computations(text)
  times, unknown = loop_multipliers(comps, entry, manifest_trips)
  out = []
  for comp, lines in comps.items():
    if comp not in times:
      continue
    for line in lines:
      m = _INSTR.match(line)
      if not m:
        continue
      kind = m.group(3).replace("-start", "")
      if kind not in KINDS or m.group(3).endswith("-done"):
        continue
      result = m.group(2)
      if m.group(3).endswith("-start"):   # (operand, result) tuple of an async start: its result
        result = ",".join(f"{d}[{','.join(map(str, s))}]" for d, s in arrays(result)[len(arrays(result)) // 2:])
      sent = [0] * n
      pairs = None
      if kind == "collective-permute":
        pairs = [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=")[1])]
        groups = None
        for src, _ in pairs:
          sent[src] = nbytes(result)
      else:
        groups = groups_of(line, n)
        for g in groups:
          for d in g:
            if len(g) > 1:
              sent[d] = nbytes(result) * (len(g) if kind == "reduce-scatter" else 1)
      op = re.search(r'op_name="([^"]*)"', line)
      first = arrays(result)[0] if arrays(result) else ("?", ())
      out.append({"kind": kind, "dtype": first[0], "shape": [list(s) for _, s in arrays(result)],
                  "groups": groups, "pairs": pairs, "device_bytes": sent, "bytes": max(sent), "times": times[comp],
                  "computation": comp, "op_name": op.group(1) if op else "", "name": m.group(1)})
  return out, unknown


# ---- compiling and running -----------------------------------------------------------------------------------------

def _entry_shardings(func, ir):
  """(per argument, per result) the sharding string of the Sharding custom-call that consumes the argument or
  produces the result (through reshapes, copies and converts); None where none does."""
  block = func.regions[0].blocks[0]
  alias = {a: i for i, a in enumerate(block.arguments)}
  arg_sh, produced, returned = {}, {}, []
  for op in block.operations:
    op = op.operation
    if op.name in ("stablehlo.reshape", "stablehlo.copy", "stablehlo.convert") and len(op.operands) == 1:
      src = op.operands[0]
      if src in alias:
        alias[op.results[0]] = alias[src]
      if src in produced:
        produced[op.results[0]] = produced[src]
    elif op.name == "stablehlo.custom_call" and ir.StringAttr(op.attributes["call_target_name"]).value == "Sharding":
      s = ir.StringAttr(op.attributes["mhlo.sharding"]).value
      src = op.operands[0]
      if src in alias and alias[src] not in arg_sh:
        arg_sh[alias[src]] = s
      produced[op.results[0]] = s
    elif op.name == "func.return":
      returned = list(op.operands)
  return ([arg_sh.get(i) for i in range(len(block.arguments))], [produced.get(v) for v in returned])


def _even(sharding, shape):
  """Whether HLO sharding text `sharding` (or None) splits every dim of `shape` evenly."""
  m = re.search(r"devices=\[([\d,]+)\]", sharding or "")
  tiles = [int(x) for x in m.group(1).split(",")] if m else []
  return all(int(d) % t == 0 for d, t in zip(shape, tiles))


def partition_and_run(directory, spec):
  """Compiles and runs one program (see the module docstring); returns its result record."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax._src.interpreters import mlir as jmlir  # pylint: disable=g-import-not-at-top
  from jax._src.lib import _jax, xla_client as xc  # pylint: disable=g-import-not-at-top
  from jax._src.lib.mlir import ir  # pylint: disable=g-import-not-at-top
  from jax._src.sharding_impls import GSPMDSharding  # pylint: disable=g-import-not-at-top

  jax.config.update("jax_enable_x64", True)   # 64-bit inputs stay 64-bit, as the module's parameters are
  name, n = spec["name"], spec["devices"]
  path = os.path.join(directory, name)
  stablehlo = _jax.mlir.hlo_to_stablehlo(open(path + ".hlo.pb", "rb").read())
  with jmlir.make_ir_context(), ir.Location.unknown():
    module = ir.Module.parse(stablehlo)
    func = next(op.operation for op in module.body.operations if op.operation.name == "func.func" and
                ir.StringAttr(op.operation.attributes["sym_name"]).value == "main")
    arg_sh, res_sh = _entry_shardings(func, ir)
    arg_sh = [given or found for given, found in zip(spec.get("arg_shardings") or arg_sh, arg_sh)]
    res_sh = [given or found for given, found in zip(spec.get("result_shardings") or res_sh, res_sh)]
    if "mhlo.input_output_alias" in module.operation.attributes:   # (variables' buffers are not donated here)
      del module.operation.attributes["mhlo.input_output_alias"]
    signature = ir.FunctionType(ir.TypeAttr(func.attributes["function_type"]).value)
    shapes = [tuple(ir.RankedTensorType(t).shape) for t in signature.results]
    # XLA's boundary takes even layouts only (jax refuses an uneven argument): an argument or result its layout
    # splits unevenly crosses it replicated, and the Sharding custom-call inside lays it out.
    arg_sh = [s if _even(s, ir.RankedTensorType(t).shape) else None for s, t in zip(arg_sh, signature.inputs)]
    res_sh = [s if _even(s, shape) else None for s, shape in zip(res_sh, shapes)]

    def attrs(shardings):
      return ir.ArrayAttr.get([ir.DictAttr.get({"mhlo.sharding": ir.StringAttr.get(s or "{replicated}")})
                               for s in shardings])
    func.attributes["arg_attrs"] = attrs(arg_sh)
    func.attributes["res_attrs"] = attrs(res_sh)
    text = module.operation.get_asm(enable_debug_info=True)   # (op names, as locations, reach the HLO)
  devices = jax.devices()[:n]
  options = xc.CompileOptions()
  options.num_replicas, options.num_partitions = 1, n
  options.device_assignment = xc.DeviceAssignment.create(np.array([[d.id for d in devices]], dtype=np.int32))
  build = options.executable_build_options
  build.use_spmd_partitioning, build.use_shardy_partitioner = True, False
  dump = path + ".dump"
  shutil.rmtree(dump, ignore_errors=True)
  build.debug_options.xla_dump_to = dump
  build.debug_options.xla_dump_hlo_pass_re = "spmd-partitioning"
  build.debug_options.xla_dump_hlo_as_text = True
  device_list = xc.DeviceList(tuple(devices))
  exe = devices[0].client.compile_and_load(text.encode(), device_list, options)
  after = sorted(glob.glob(os.path.join(dump, "*after_spmd-partitioning*.txt")))
  spmd_text = open(after[0]).read() if after else ""
  shutil.rmtree(dump, ignore_errors=True)
  with open(path + ".after_spmd.hlo.txt", "w") as f:
    f.write(spmd_text)
  found, unknown = collectives(spmd_text, n, spec.get("loop_trips", {}))

  in_sh, out_sh = exe.get_parameter_shardings(), exe.get_output_shardings()
  inputs = np.load(path + ".inputs.npz")
  args = [inputs[f"arr_{k}"] for k in range(len(inputs.files))]
  if len(args) != len(in_sh):
    raise ValueError(f"{name}: the module has {len(in_sh)} parameters but {len(args)} inputs were given")
  placed = [jax.device_put(a, GSPMDSharding(device_list, s)) for a, s in zip(args, in_sh)]
  shards = exe.execute_sharded(placed).disassemble_into_single_device_arrays()
  results = []
  for pieces, s, shape in zip(shards, out_sh, shapes):
    full = np.zeros(shape, np.asarray(pieces[0]).dtype)
    index = GSPMDSharding(device_list, s).devices_indices_map(shape)
    for piece in pieces:
      full[index[list(piece.devices())[0]]] = np.asarray(piece)
    results.append(full)
  np.savez(path + ".outputs.npz", *results)
  return {"name": name, "ok": True, "collectives": found, "unknown_loops": unknown,
          "param_shardings": [str(xc.HloSharding.from_proto(s)) for s in in_sh],
          "output_shardings": [str(xc.HloSharding.from_proto(s)) for s in out_sh]}


def main(directory):
  manifest = json.load(open(os.path.join(directory, "manifest.json")))
  for spec in manifest["programs"]:
    try:
      record = partition_and_run(directory, spec)
    except Exception as e:  # pylint: disable=broad-except
      record = {"name": spec["name"], "ok": False, "error": f"{type(e).__name__}: {e}",
                "trace": traceback.format_exc()[-3000:]}
    with open(os.path.join(directory, spec["name"] + ".result.json"), "w") as f:
      json.dump(record, f)
    print(f"xla_partition: {spec['name']}: {'ok' if record['ok'] else record['error']}", file=sys.stderr, flush=True)


if __name__ == "__main__":
  main(sys.argv[1])
