"""Trainer-side client of the token feeder."""
from client.dataset import FeederDataset
from client.stream import ClientConfig, FeederBatch, FeederClient

__all__ = ["FeederDataset", "FeederBatch", "FeederClient", "ClientConfig"]
