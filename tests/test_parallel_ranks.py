"""feeder_client.parallel (issue 33): a framework's parallel layout -> the feeder stream a process
reads (data-parallel rank and size, member of members, context-parallel slice). Real meshes: a
4-process gloo group builds a torch DeviceMesh and initializes Megatron-core's parallel_state;
DeepSpeed's PipelineEngine is covered end to end by tests/test_pipeline.py."""
from __future__ import annotations

import os

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


def _worker(rank: int, port: int, q) -> None:
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
    q.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_real_device_meshes_and_megatron_parallel_state_in_four_processes():
    import torch.multiprocessing as tmp

    from tests.helpers import free_port

    ctx = tmp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, q)) for r in range(4)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=240) for _ in range(4))
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
