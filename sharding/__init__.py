"""Device meshes, logical-axis rules and partitioning of parameters and optimizer state."""
