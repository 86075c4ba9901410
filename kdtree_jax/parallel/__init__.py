"""Device meshes, shardings and multi-host start-up."""
