"""Pipelines: the driver-side programs that build clusters and run an algorithm's loop."""
