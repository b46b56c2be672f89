"""A parameter in a bucket: its flat layout, its pieces and DTensor faces, what its module registers."""
