"""Trainer-side client of the token feeder."""
from .dataset import FeederDataset
from .stream import ClientConfig, FeederBatch, FeederClient, feeder_info

__all__ = ["FeederDataset", "FeederBatch", "FeederClient", "ClientConfig", "feeder_info"]
