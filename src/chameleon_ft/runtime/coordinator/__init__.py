"""The coordinator: the process that owns the store and performs what the control plane
decides (publishing generations, launching and fencing workers, writing checkpoints and
the report)."""
