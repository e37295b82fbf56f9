"""The one-graph form on CPUs: every device of a process as one TF graph, ops stacked over a device dimension,
collectives as the ops that compute them."""
