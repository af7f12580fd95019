"""A training rank's client of the token feeder, installed as `feeder_client`.

FeederDataset (a torch IterableDataset) for the training loop; FeederClient, the stream
beneath it; ClientConfig; feeder_info for the dataset's facts before training starts. Imports
inside this package are relative, so it runs under its folder's name too; import it as
`feeder_client` only (two names would make two copies of every class)."""
from .dataset import FeederDataset
from .stream import ClientConfig, FeederBatch, FeederClient, feeder_info

__all__ = ["FeederDataset", "FeederBatch", "FeederClient", "ClientConfig", "feeder_info"]
