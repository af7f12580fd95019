"""Token feeder: regional services that stream packed token batches to trainer ranks."""
__version__ = "0.1.0"
