"""GraphDef reading and editing, with no shardings: views, the IR of static shapes, function bodies, loops,
shapes TF leaves unknown, and the per-device tables."""
