"""The engine: units and their buckets, the flat layout, the step's schedule and collectives, the
mesh, the DTensor pieces users see, host buffers and offloading, meta-device init."""
