"""The job's parallel layout, owned by one object: built once from the resolved `parallel` section and the world
size, it holds every derived size and builds the device mesh. Every lever, the data plane, the loss and checkpoints
ask it; nothing else divides the world size.

Ranks are laid out ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index: the groups that talk most (tensor,
then context parallelism) sit on one node's GPUs, and a pipeline's stages, which pass only activations, span nodes.
FSDP2 shards the weights over dp and cp together (the ranks of a context-parallel group hold the same weights).
"""

from __future__ import annotations

from dataclasses import dataclass

from holotrain.errors import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    world: int
    pp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # expert parallelism: experts sharded over this many of the data-parallel ranks (1: off)

    def __post_init__(self):
        for name in ("pp", "cp", "tp", "ep"):
            n = getattr(self, name)
            if n < 1:
                raise ConfigError(f"parallel.{name} must be >= 1, got {n}")
        what = " x ".join(f"parallel.{k}={n}" for k, n in (("pp", self.pp), ("cp", self.cp), ("tp", self.tp)) if n > 1)
        if self.world == 1 and self.model_ranks > 1:
            raise ConfigError(f"{what} needs {self.model_ranks} ranks: launch with torchrun "
                              f"--nproc_per_node={self.model_ranks}")
        if self.world % self.model_ranks:
            raise ConfigError(f"{what} needs a multiple of {self.model_ranks} ranks (world size {self.world})")
        if self.dp % self.ep:
            hint = (f": launch with torchrun --nproc_per_node={self.ep * self.model_ranks}" if self.world == 1 else
                    "")
            raise ConfigError(f"parallel.ep={self.ep} must divide the data-parallel ranks ({self.dp}){hint}")

    @classmethod
    def of(cls, section, world_size: int) -> ParallelDims:
        """From a `parallel` config section (or anything with its pp, cp and tp) and the number of ranks."""
        return cls(world=world_size, pp=section.pp, cp=section.cp, tp=section.tp, ep=getattr(section, "ep", 1))

    @staticmethod
    def fits(world: int, pp: int = 1, cp: int = 1, tp: int = 1) -> bool:
        """Whether `world` ranks divide into replicas of pp x cp x tp (a candidate layout, for the planners)."""
        return world % (pp * cp * tp) == 0

    @property
    def model_ranks(self) -> int:
        """Ranks that hold one replica of the model between them (its stages, sequence shards and tensor shards)."""
        return self.pp * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel replicas: the ranks (of one stage) that each train on their own rows."""
        return self.world // self.model_ranks

    @property
    def expert_dp(self) -> int:
        """Data-parallel ranks that hold the same experts (FSDP2 shards the expert weights over these): dp / ep."""
        return self.dp // self.ep

    @property
    def batch_group(self) -> int:
        """Ranks of one stage that take the same rows: a tensor- and context-parallel group (adjacent ranks)."""
        return self.cp * self.tp

    @property
    def sequence_shards(self) -> int:
        """How many pieces each sequence's tokens are cut into between blocks (sequence and context parallelism)."""
        return self.cp * self.tp

    def dp_index(self, rank: int) -> int:
        """The data-parallel replica (which rows) of a global rank."""
        return (rank // self.batch_group) % self.dp

    def pp_index(self, rank: int) -> int:
        """The pipeline rank ("pp", the mesh's outermost dimension) of a global rank."""
        return rank // (self.dp * self.batch_group)

    def build_mesh(self, device_type: str):
        """The job's DeviceMesh: dimensions ("pp", "dp", "cp", "tp"), of which a size-1 one other than "dp" is left
        out (("dp",) for plain data parallelism); None on one process. With ep > 1, "dp" is split into ("edp", "ep"),
        the expert-parallel groups of adjacent data-parallel ranks, and "dp" is their flattening (same ranks, same
        order), so the levers that read "dp" see no difference."""
        if self.world == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        data = [("edp", self.expert_dp), ("ep", self.ep)] if self.ep > 1 else [("dp", self.dp)]
        dims = [(name, n) for name, n in (("pp", self.pp), *data, ("cp", self.cp), ("tp", self.tp))
                if n > 1 or name in ("dp", "edp", "ep")]
        mesh = init_device_mesh(device_type, tuple(n for _, n in dims), mesh_dim_names=tuple(k for k, _ in dims))
        if self.ep > 1:
            mesh["edp", "ep"]._flatten("dp")
        return mesh
