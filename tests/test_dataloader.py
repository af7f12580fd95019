"""FeederDataset under torch's DataLoader: workers by fork and spawn, no duplicates, same order."""
import multiprocessing as mp
import os

import pytest
from torch.utils.data import DataLoader

from feeder_client import FeederDataset
from feeder.core.sampler import n_samples
from tests.helpers import reference_ids


@pytest.mark.parametrize("workers,context", [(0, None), (4, "fork"), (4, "spawn")])
def test_each_sample_once_in_order(feeder, stream, workers, context):
    ds = FeederDataset([feeder.address], job=f"dl-{workers}-{context}", rank=1, world_size=2, seq_len=40,
                       micro_batch=8, seed=4, num_epochs=2)
    assert ds.client is None  # nothing gRPC exists before the fork
    dl = DataLoader(ds, batch_size=None, num_workers=workers,
                    multiprocessing_context=mp.get_context(context) if context else None)
    got = [(b.epoch, b.sample_ids.tolist()) for b in dl]
    n = n_samples(len(stream), 40)
    for epoch in (0, 1):
        ids = [i for e, b in got if e == epoch for i in b]
        assert ids == reference_ids(n, 2, 1, shuffle=True, seed=4, drop_last=False, epoch=epoch)


def test_anchors_of_processes_that_died_without_cleanup_are_removed(tmp_path):
    """A trainer ended by SIGKILL or os._exit leaves its datasets' cursor anchors in /dev/shm:
    the next dataset made on the host removes those of dead processes, and only those."""
    import subprocess
    import sys

    from feeder_client.dataset import _remove_orphaned_anchors

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    orphan = tmp_path / f"feeder-dataset-{dead}-{'a' * 32}.cursor"
    mine = tmp_path / f"feeder-dataset-{os.getpid()}-{'b' * 32}.cursor"
    other = tmp_path / "feeder-dataset-notapid.cursor"
    for p in (orphan, mine, other):
        p.write_bytes(b"N")
    assert _remove_orphaned_anchors(str(tmp_path)) == 1
    assert not orphan.exists() and mine.exists() and other.exists()
