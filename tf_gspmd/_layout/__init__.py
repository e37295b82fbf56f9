"""The values users write: meshes and specs, shardings, annotations, plan scopes, pipeline schedules."""
