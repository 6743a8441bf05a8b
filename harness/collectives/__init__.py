"""The shared allreduce layer: the backends one op at a time, and what their results mean."""
