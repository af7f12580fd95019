"""feeder_client.parallel (issue 33): a framework's parallel layout -> the feeder stream a process
reads (data-parallel rank and size, member of members, context-parallel slice). Real meshes: a
4-process gloo group builds a torch DeviceMesh, initializes Megatron-core's parallel_state, then
DeepSpeed with Ulysses sequence parallelism (data_parallel_size 2 x sequence_parallel_size 2), whose
processes stream from a live feeder; DeepSpeed's PipelineEngine is covered end to end by
tests/test_pipeline.py."""
from __future__ import annotations

import os

import numpy as np
import pytest

from feeder_client.parallel import FeederRanks, mesh_ranks


def test_the_rule_for_every_combination_of_dimensions():
    # data parallel only
    assert mesh_ranks(dp=(3, 8)) == FeederRanks(rank=3, world_size=8)
    # tensor parallel: every tp rank a member of its dp rank
    assert mesh_ranks(dp=(1, 2), tp=(3, 4)) == FeederRanks(rank=1, world_size=2, member=3, members=4)
    # pipeline: first and last stages read (tp ranks of each), middle ones do not
    assert mesh_ranks(dp=(0, 2), tp=(1, 2), pp=(0, 4)) == FeederRanks(0, 2, member=1, members=4)
    assert mesh_ranks(dp=(0, 2), tp=(1, 2), pp=(3, 4)) == FeederRanks(0, 2, member=3, members=4)
    assert not mesh_ranks(dp=(0, 2), tp=(1, 2), pp=(1, 4)).reads
    assert mesh_ranks(dp=(0, 1), pp=(1, 2)) == FeederRanks(0, 1, member=1, members=2)
    # context parallel: each cp rank its own slice and members
    assert mesh_ranks(dp=(1, 2), tp=(1, 2), cp=(3, 4)) == FeederRanks(1, 2, member=1, members=2, cp_rank=3, cp_size=4)
    # every member index is distinct within a (dp, cp) rank
    seen = {(r.member) for t in range(4) for s in range(3) if (r := mesh_ranks(dp=(0, 1), tp=(t, 4), pp=(s, 3))).reads}
    assert seen == set(range(8))
    with pytest.raises(ValueError, match=r"tp must be \(rank, size\)"):
        mesh_ranks(dp=(0, 1), tp=(2, 2))


def test_ulysses_from_accelerates_config_and_an_mpu_and_a_mesh_with_ring_and_ulysses_refused():
    """What the 4-process test below cannot build on CPU: Accelerate's sp_size (DeepSpeed's ALST,
    which builds no mesh) before prepare, DeepSpeed's ALST mpu (a sequence-data-parallel group
    of dp x sp processes), and a mesh naming both kinds of context parallelism."""
    from types import SimpleNamespace

    from feeder_client.parallel import feeder_ranks, from_deepspeed, from_device_mesh

    class Accelerator:   # (feeder_ranks tells an Accelerator by its type's name)
        process_index, num_processes, torch_device_mesh, deepspeed_engine_wrapped = 3, 4, None, None
        parallelism_config = SimpleNamespace(sp_size=2)

    ulysses = FeederRanks(1, 2, cp_rank=1, cp_size=2, cp_layout="contiguous")
    assert feeder_ranks(Accelerator()) == ulysses
    assert feeder_ranks(Accelerator()).kwargs()["cp_layout"] == "contiguous"
    mpu = SimpleNamespace(get_sequence_parallel_rank=lambda: 1, get_sequence_parallel_world_size=lambda: 2,
                          get_sequence_data_parallel_rank=lambda: 3, get_sequence_data_parallel_world_size=lambda: 4,
                          initialize_sequence_parallel=None)
    assert from_deepspeed(SimpleNamespace(mpu=mpu)) == ulysses
    mesh = SimpleNamespace(mesh_dim_names=("dp", "cp", "sp"), shape=(1, 2, 2), get_coordinate=lambda: [0, 1, 1])
    with pytest.raises(ValueError, match=r"both ring \(cp, 2\) and Ulysses \(sp, 2\)"):
        from_device_mesh(mesh)
    with pytest.raises(ValueError, match="cp_layout must be zigzag"):
        mesh_ranks(dp=(0, 1), cp=(0, 2), cp_layout="ring")


def _worker(rank: int, port: int, address: str, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="4",
                      LOCAL_RANK=str(rank))
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from feeder_client.parallel import feeder_ranks

    dist.init_process_group("gloo", rank=rank, world_size=4)
    out = {"dp_tp": feeder_ranks(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))),
           "accelerate": feeder_ranks(init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard",
                                                                                          "cp"))),
           "lightning": feeder_ranks(init_device_mesh("cpu", (2, 2),
                                                      mesh_dim_names=("data_parallel", "tensor_parallel")))}
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    out["megatron_tp_pp"] = feeder_ranks(ps)
    # the integrations take Megatron's layout by themselves once it is initialized
    from feeder_trainer.integrations.common import DistributedFeederDataset

    ds = DistributedFeederDataset("127.0.0.1:1", job="j", seq_len=16, micro_batch=1)
    out["dataset"] = (ds.spec.rank, ds.spec.world_size, ds.spec.member, ds.spec.members)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(context_parallel_size=2)
    out["megatron_cp"] = feeder_ranks(ps)
    ps.destroy_model_parallel()
    # DeepSpeed's name for Ulysses in its own mesh
    out["ds_mesh"] = feeder_ranks(init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel",
                                                                                   "sequence_parallel")))
    import deepspeed
    import torch

    engine, *_ = deepspeed.initialize(model=torch.nn.Linear(2, 2), config={
        "train_micro_batch_size_per_gpu": 1, "data_parallel_size": 2, "sequence_parallel_size": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    out["ulysses"] = r = feeder_ranks(engine)
    ds = DistributedFeederDataset(address, job="ulysses", seq_len=16, micro_batch=2, parallel=engine)
    out["ulysses_spec"] = (ds.spec.rank, ds.spec.world_size, ds.spec.cp_rank, ds.spec.cp_size, ds.spec.cp_layout)
    it = iter(ds)
    b = next(it)   # both sequence-parallel processes of a data-parallel rank are served, each its slice
    it.close()
    out["ulysses_batch"] = (b.sample_ids.tolist(), b.tokens.tolist())
    q.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(420)
def test_real_device_meshes_megatron_parallel_state_and_deepspeed_ulysses_in_four_processes(feeder, stream):
    import torch.multiprocessing as tmp

    from feeder.core import context
    from feeder.core.sampler import n_samples
    from tests.helpers import free_port, reference_ids

    ctx = tmp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, feeder.address, q)) for r in range(4)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=360) for _ in range(4))
    for p in procs:
        p.join(60)
    F = FeederRanks
    # (dp, tp) 2 x 2: global rank = dp * 2 + tp
    assert [got[r]["dp_tp"] for r in range(4)] == [F(0, 2, 0, 2), F(0, 2, 1, 2), F(1, 2, 0, 2), F(1, 2, 1, 2)]
    assert [got[r]["lightning"] for r in range(4)] == [got[r]["dp_tp"] for r in range(4)]
    # Accelerate's names: replicate x shard is the data-parallel rank; cp its own slices
    assert [got[r]["accelerate"] for r in range(4)] == [F(0, 2, cp_rank=0, cp_size=2), F(0, 2, cp_rank=1, cp_size=2),
                                                        F(1, 2, cp_rank=0, cp_size=2), F(1, 2, cp_rank=1, cp_size=2)]
    # Megatron tp 2 x pp 2 in 4 processes: one data-parallel rank; 2 tp ranks of each end stage
    mg = [got[r]["megatron_tp_pp"] for r in range(4)]
    assert {(m.rank, m.world_size, m.members) for m in mg} == {(0, 1, 4)} and sorted(m.member for m in mg) == [0, 1, 2, 3]
    assert [got[r]["dataset"] for r in range(4)] == [(m.rank, m.world_size, m.member, m.members) for m in mg]
    cp = [got[r]["megatron_cp"] for r in range(4)]
    assert sorted((m.rank, m.cp_rank) for m in cp) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(m.world_size == 2 and m.cp_size == 2 and m.members == 1 for m in cp)
    # DeepSpeed Ulysses, data_parallel_size 2 x sequence_parallel_size 2 (sp groups of consecutive
    # ranks): each sp rank its own contiguous slice of its data-parallel rank's samples
    ul = [F(d, 2, cp_rank=c, cp_size=2, cp_layout="contiguous") for d in (0, 1) for c in (0, 1)]
    assert [got[r]["ulysses"] for r in range(4)] == ul
    assert [got[r]["ds_mesh"] for r in range(4)] == ul
    assert [got[r]["ulysses_spec"] for r in range(4)] == [(u.rank, 2, u.cp_rank, 2, "contiguous") for u in ul]
    n = n_samples(len(stream), 16)
    for r, u in enumerate(ul):
        ids, tokens = got[r]["ulysses_batch"]
        assert ids == reference_ids(n, 2, u.rank, shuffle=True, seed=0, drop_last=False, epoch=0)[:2]
        whole = np.stack([stream[i * 16:i * 16 + 17] for i in ids]).astype(np.int64)
        assert tokens == context.cut(whole, 16, 2, u.cp_rank, "contiguous").tolist()
