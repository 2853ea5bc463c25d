"""Kedro-free training: parameters, the Accelerate launcher, the per-process entry point, checkpoints."""
