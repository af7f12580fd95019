"""The feeder in the frameworks people train with: Accelerate, the Hugging Face Trainer and Lightning.

Each framework wraps a dataset in a DataLoader of its own and has its own idea of distributed
iterable datasets (Accelerate dispatches rank 0's batches or shards every rank's stream again;
the Trainer re-batches and, on resume, skips batches by pulling them). A FeederDataset is
already one rank's exact DistributedSampler stream, so each integration keeps the framework's
hands off it, saves every rank's cursor in the framework's own checkpoint and resumes from it:

* `common`: DistributedFeederDataset (rank/world from the process group; refuses to be
  sharded, dispatched or re-batched) and FeederLoader (the per-rank loader with a cursor).
* `accelerate`: prepare_feeder(accelerator, dataset) (no extra dependency beyond accelerate).
* `hf`: FeederTrainer (transformers.Trainer).
* `lightning`: FeederDataModule (lightning or pytorch_lightning).

Installed as feeder_trainer.integrations; each framework's module imports its framework only
when imported itself (the `frameworks` extra installs all three).
"""
from .common import DistributedFeederDataset, FeederLoader, rank_and_world

__all__ = ["DistributedFeederDataset", "FeederLoader", "rank_and_world"]
