"""Trainer-side client of the token feeder."""
from client.dataset import FeederDataset
from client.stream import ClientConfig, FeederBatch, FeederClient, feeder_info

__all__ = ["FeederDataset", "FeederBatch", "FeederClient", "ClientConfig", "feeder_info"]
