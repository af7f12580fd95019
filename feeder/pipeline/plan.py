"""The plan types, re-exported: they live in `feeder.planning`, below both the sources and
the pipeline, so that a source that plans its own streams (Kafka) need not import upward."""
from feeder.planning import PlannedBatch, PlannedRun, Start, StreamPlan

__all__ = ["PlannedBatch", "PlannedRun", "Start", "StreamPlan"]
