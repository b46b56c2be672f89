"""Process groups and meshes (data-parallel shard and outer dims, expert groups) and the collectives over them."""
