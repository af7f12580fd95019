"""Which feeder stream a process of a model-parallel job reads: its data-parallel rank and size,
which member of that rank it is, and its context-parallel slice (docs/model-parallel.md).

    from feeder_client.parallel import feeder_ranks
    r = feeder_ranks(deepspeed_engine)          # or a DeviceMesh, Megatron's parallel_state, an
    if r.reads:                                 # Accelerator, Lightning's ModelParallelStrategy
        ds = FeederDataset(targets, job=..., seq_len=..., micro_batch=..., **r.kwargs())

The rule, the same for every framework:

* rank, world_size: the data-parallel ones (DistributedSampler's num_replicas is the number of
  data-parallel replicas, never the number of processes);
* the members of a rank: every tensor-parallel rank of its first pipeline stage, and of its last
  one (DeepSpeed's PipelineEngine and Megatron read data on both); middle stages read nothing
  (`reads` is False). members = tp × (2 with pipeline stages, else 1);
* cp_rank, cp_size: the context-parallel ones; each context-parallel rank has its own members.
  cp_layout: how a sample is split among them: "zigzag" for ring attention (Megatron's context
  parallelism, torch's context_parallel: a DeviceMesh's cp), "contiguous" for Ulysses (DeepSpeed's
  sequence parallelism: `sequence_parallel_size`, a mesh's sequence_parallel or sp).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FeederRanks:
    rank: int            # data-parallel rank
    world_size: int      # data-parallel size
    member: int = 0
    members: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    reads: bool = True   # False on a middle pipeline stage: it takes no data
    cp_layout: str = "zigzag"   # "contiguous" for Ulysses (zigzag whenever cp_size is 1)

    def kwargs(self) -> dict:
        """FeederDataset's arguments for this process (rank, world_size, member, members, cp_rank,
        cp_size, cp_layout)."""
        return dict(rank=self.rank, world_size=self.world_size, member=self.member, members=self.members,
                    cp_rank=self.cp_rank, cp_size=self.cp_size, cp_layout=self.cp_layout)


def mesh_ranks(*, dp: tuple[int, int], tp: tuple[int, int] = (0, 1), pp: tuple[int, int] = (0, 1),
               cp: tuple[int, int] = (0, 1), cp_layout: str = "zigzag") -> FeederRanks:
    """The stream of a process at (rank, size) of each parallel dimension: data (dp), tensor (tp),
    pipeline (pp: stage, stages) and context (cp, split as cp_layout: "zigzag" for ring attention,
    "contiguous" for Ulysses)."""
    (dp_rank, dp_size), (tp_rank, tp_size), (stage, stages), (cp_rank, cp_size) = dp, tp, pp, cp
    for name, (r, n) in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp)):
        if not (isinstance(r, int) and isinstance(n, int) and 0 <= r < n):
            raise ValueError(f"{name} must be (rank, size) with 0 <= rank < size, got {(r, n)}")
    if cp_layout not in ("zigzag", "contiguous"):
        raise ValueError(f"cp_layout must be zigzag (ring attention) or contiguous (Ulysses), got {cp_layout!r}")
    ends = 2 if stages > 1 else 1
    last = stage == stages - 1 and stages > 1
    reads = stage == 0 or last
    return FeederRanks(rank=dp_rank, world_size=dp_size, member=tp_rank + tp_size * int(last) if reads else 0,
                       members=tp_size * ends, cp_rank=cp_rank, cp_size=cp_size, reads=reads,
                       cp_layout=cp_layout if cp_size > 1 else "zigzag")


def from_deepspeed(engine) -> FeederRanks:
    """A DeepSpeed engine's: a PipelineEngine's grid (data-parallel id, stages, the model-parallel
    slice), else the engine's mpu when it has one, else the data-parallel group's; with DeepSpeed's
    sequence parallelism (Ulysses: `sequence_parallel_size` in the config, or an mpu that has a
    sequence-parallel group) its group is the context-parallel one, split contiguously."""
    import torch.distributed as dist

    grid = getattr(engine, "grid", None)
    if grid is not None and hasattr(grid, "get_stage_id"):
        return mesh_ranks(dp=(grid.get_data_parallel_id(), grid.get_data_parallel_world_size()),
                          tp=(grid.get_slice_parallel_rank(), grid.get_slice_parallel_world_size()),
                          pp=(grid.get_stage_id(), grid.get_pipe_parallel_world_size()))
    mpu = getattr(engine, "mpu", None)
    sp = (0, 1)
    if mpu is not None and hasattr(mpu, "get_sequence_parallel_world_size"):
        sp = (mpu.get_sequence_parallel_rank(), mpu.get_sequence_parallel_world_size())
    elif int(getattr(engine, "sequence_parallel_size", 1) or 1) > 1:
        group = engine.seq_parallel_group
        sp = (dist.get_rank(group), dist.get_world_size(group))
    if mpu is not None and hasattr(mpu, "get_data_parallel_rank"):
        tp = (mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()) \
            if hasattr(mpu, "get_model_parallel_rank") else (0, 1)
        return mesh_ranks(dp=(mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()), tp=tp, cp=sp,
                          cp_layout="contiguous")
    if mpu is not None and hasattr(mpu, "get_sequence_data_parallel_rank"):
        # DeepSpeed's Ulysses groups alone (ALST, Accelerate's sp_size): its "sequence data parallel"
        # group is every process of the data-parallel and sequence-parallel ranks, sp groups of
        # consecutive ranks inside it
        sdp = (mpu.get_sequence_data_parallel_rank(), mpu.get_sequence_data_parallel_world_size())
        return mesh_ranks(dp=(sdp[0] // sp[1], sdp[1] // sp[1]), cp=sp, cp_layout="contiguous")
    group = getattr(engine, "data_parallel_group", None)
    return mesh_ranks(dp=(dist.get_rank(group), dist.get_world_size(group)), cp=sp, cp_layout="contiguous")


def from_megatron(parallel_state) -> FeederRanks:
    """megatron.core.parallel_state's, once initialized (initialize_model_parallel)."""
    ps = parallel_state
    return mesh_ranks(dp=(ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()),
                      tp=(ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
                      pp=(ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()),
                      cp=(ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()))


# Names the frameworks give each dimension of a torch DeviceMesh.
DIMS = {"dp": ("dp", "dp_replicate", "dp_shard", "data_parallel", "data"),
        "tp": ("tp", "tensor_parallel", "tensor"), "pp": ("pp", "pipeline_parallel", "pipe"),
        "cp": ("cp", "context_parallel", "context"), "sp": ("sp", "sequence_parallel")}
# cp: ring attention (torch's context_parallel, Megatron's), the zigzag layout. sp: Ulysses (DeepSpeed
# names its dimension sequence_parallel, Accelerate sp), the contiguous layout. (Megatron's own
# "sequence parallelism" slices activations, not data: it is no dimension of a mesh.)


def from_device_mesh(mesh) -> FeederRanks:
    """A torch DeviceMesh's, by its dimension names (Accelerate's dp_replicate, dp_shard, cp, tp;
    Lightning's data_parallel, tensor_parallel; torchtitan's dp, tp, cp, pp). Data-parallel
    dimensions (replicate and shard) are one data-parallel rank together."""
    names = tuple(mesh.mesh_dim_names or ())
    unknown = [n for n in names if not any(n in v for v in DIMS.values())]
    if unknown:
        raise ValueError(f"device mesh dimensions {unknown} are none of {sorted(sum(DIMS.values(), ()))}: "
                         "say which is which with mesh_ranks(dp=..., tp=..., pp=..., cp=...)")
    coords = dict(zip(names, mesh.get_coordinate() or [0] * len(names)))
    sizes = dict(zip(names, mesh.shape))

    def dim(kind: str) -> tuple[int, int]:
        rank, size = 0, 1
        for n in names:
            if n in DIMS[kind]:
                rank, size = rank * sizes[n] + coords[n], size * sizes[n]
        return rank, size

    cp, sp = dim("cp"), dim("sp")
    if cp[1] > 1 and sp[1] > 1:
        raise ValueError(f"device mesh {names} has both ring (cp, {cp[1]}) and Ulysses (sp, {sp[1]}) context "
                         "parallelism: the feeder splits a sample one way; say which with mesh_ranks(..., cp=..., "
                         "cp_layout=...)")
    if sp[1] > 1:
        return mesh_ranks(dp=dim("dp"), tp=dim("tp"), pp=dim("pp"), cp=sp, cp_layout="contiguous")
    return mesh_ranks(dp=dim("dp"), tp=dim("tp"), pp=dim("pp"), cp=cp)


def from_accelerate(accelerator) -> FeederRanks:
    """An Accelerator's: its ParallelismConfig's device mesh when it has one (cp: ring attention);
    else, with sp_size > 1 (DeepSpeed's Ulysses, which builds no mesh), its DeepSpeed engine's
    groups, or before prepare the config's (sp groups of consecutive processes, as DeepSpeed makes
    them); else its processes."""
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is not None:
        return from_device_mesh(mesh)
    pc = getattr(accelerator, "parallelism_config", None)
    sp = int(getattr(pc, "sp_size", None) or 1)
    if sp > 1:
        wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
        if wrapped is not None:
            return from_deepspeed(wrapped.engine)
        i, n = accelerator.process_index, accelerator.num_processes
        return mesh_ranks(dp=(i // sp, n // sp), cp=(i % sp, sp), cp_layout="contiguous")
    return mesh_ranks(dp=(accelerator.process_index, accelerator.num_processes))


def feeder_ranks(obj) -> FeederRanks:
    """Any of the above, told apart by what it is: a DeepSpeed engine, a DeviceMesh, Megatron's
    parallel_state module, an Accelerator, a Lightning strategy with a device_mesh, or Lightning's
    DeepSpeedStrategy (its engine, once set up)."""
    kind = type(obj).__name__
    if kind == "DeepSpeedStrategy" and getattr(obj, "deepspeed_engine", None) is not None:   # Lightning
        return from_deepspeed(obj.deepspeed_engine)
    if kind == "DeviceMesh":
        return from_device_mesh(obj)
    if hasattr(obj, "get_tensor_model_parallel_rank") and hasattr(obj, "get_context_parallel_rank"):
        return from_megatron(obj)
    if kind == "Accelerator":
        return from_accelerate(obj)
    if hasattr(obj, "device_mesh") and type(obj.device_mesh).__name__ == "DeviceMesh":   # Lightning
        return from_device_mesh(obj.device_mesh)
    if hasattr(obj, "train_batch") or hasattr(obj, "grid") or hasattr(obj, "mpu"):
        return from_deepspeed(obj)
    raise TypeError(f"feeder_ranks takes a DeepSpeed engine, a DeviceMesh, megatron.core.parallel_state, an "
                    f"Accelerator or a strategy with a device_mesh, got {kind}")
