"""TF's collective ops: the vocabulary (the one place their op types are named), the mesh's groups, the one
builder, widths, static shapes, combining and launch order."""
