"""The front end: a Python function traced to a GraphDef, Grappler's folding, the annotations read."""
