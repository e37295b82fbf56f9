"""The per-device tables: constants partitioning adds to a per-device program, one row per partition id, read at
the device's own id; and the names under which partitioning's own ops live."""

import numpy as np
import tensorflow as tf

PARTITION_ID = "gspmd/partition_id"
HELPER_SCOPE = "/gspmd/"   # the ops partitioning adds for node n are named `n/gspmd/...`
TABLES_SCOPE = "gspmd/tables/"   # per-device constant tables (one per distinct content), read at the partition id


def table_key(table):
  """What identifies a per-device table's content (dtype, shape, bytes)."""
  table = np.asarray(table)
  return table.dtype.str, table.shape, table.tobytes()


def table_constant(tables, table, name):
  """The Const holding `table` in the graph being built: the one in `tables` (by `table_key`) when it holds the
  same values, else a new one under TABLES_SCOPE, recorded there."""
  key = table_key(table)
  if key not in tables:
    with tf.name_scope(TABLES_SCOPE):
      tables[key] = tf.constant(np.asarray(table), name=name)
  return tables[key]
