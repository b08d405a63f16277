"""Turning rollout trajectories into training batches: packing, bucketing, padding."""
