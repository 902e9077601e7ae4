"""The parallel layout as one named device mesh: `ParallelDims`.

World = pp x dp_replicate x dp_shard x cp x tp, tp innermost (tensor parallelism stays inside a
node), pp outermost. Experts fold onto the same ranks (MoE parallel folding, Megatron-Core):
ep takes all of cp and the inner part of dp_shard, so dp_shard is itself split into
dp_shard_mod_ep (outer, over which expert weights are data-parallel) x dp_shard_in_ep (inner).
The mesh therefore has six base dimensions, each always present (size 1 when unused, so code can
ask for any name):

    pp, dp_replicate, dp_shard_mod_ep, dp_shard_in_ep, cp, tp

and these flattened ones:

    dp_shard    = dp_shard_mod_ep x dp_shard_in_ep
    dp          = dp_replicate x dp_shard         ranks that read different data
    dp_shard_cp = dp_shard x cp                   FSDP's shard group (cp ranks hold the same weights)
    dp_cp       = dp_replicate x dp_shard x cp    gradient reduction group of dense weights
    ep          = dp_shard_in_ep x cp             ranks the experts are split over

`validate` checks every size against the world and the model's shapes and needs no process
group, so a bad layout is refused before any process allocates memory.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tessera.config.errors import ParallelError
from tessera.config.layout_rules import LayoutSizes, cp_layout, layout_problems
from tessera.config.model import ModelConfig
from tessera.config.parallel import ParallelConfig

BASE_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp")
FLAT_DIMS: dict[str, tuple[str, ...]] = {
    "dp_shard": ("dp_shard_mod_ep", "dp_shard_in_ep"),
    "dp": ("dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep"),
    "dp_shard_cp": ("dp_shard_mod_ep", "dp_shard_in_ep", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp"),
    "ep": ("dp_shard_in_ep", "cp"),
}


@dataclass
class _Meshes:
    """What `build_mesh` attaches to the (frozen) sizes: the named mesh and its flattened dimensions."""

    base: DeviceMesh | None = None
    flat: dict[str, DeviceMesh] = field(default_factory=dict)


@dataclass(frozen=True)
class ParallelDims(LayoutSizes):
    """Sizes of every parallel dimension (the layout rules' `LayoutSizes`, which the validation
    checks), the world they fill and, after `build_mesh`, the named DeviceMesh."""

    world_size: int = 1
    _meshes: _Meshes = field(default_factory=_Meshes, init=False, repr=False, compare=False)

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        """Sizes from a ParallelConfig, dp_shard=-1 filled from the world; refuses sizes whose
        product is not the world."""
        try:
            dp_shard = cfg.resolved_dp_shard(world_size)
        except ValueError as e:
            raise ParallelError(str(e)) from e
        dims = cls(tp=cfg.tp, sp=cfg.sp, pp=cfg.pp, vpp=cfg.stages_per_rank, dp_replicate=cfg.dp_replicate,
                   dp_shard=dp_shard, cp=cfg.cp, ep=cfg.ep, cp_method=cfg.cp_method, world_size=world_size)
        dims.check_world(world_size)
        return dims

    # ---- sizes ---------------------------------------------------------------------------
    @property
    def dp_shard_in_ep(self) -> int:
        return self.ep // self.cp if self.ep % self.cp == 0 else 1

    @property
    def dp_shard_mod_ep(self) -> int:
        return self.dp_shard // self.dp_shard_in_ep

    def size(self, name: str) -> int:
        """Ranks along a base or flattened dimension (1 for a dimension that is not used)."""
        if name in BASE_DIMS:
            return getattr(self, name)
        if name in FLAT_DIMS:
            return math.prod(getattr(self, d) for d in FLAT_DIMS[name])
        known = ", ".join(BASE_DIMS + tuple(FLAT_DIMS))
        raise ParallelError(f"unknown mesh dimension {name!r}; known: {known}")

    @property
    def cp_layout(self) -> str:
        """How each sequence is split over the cp ranks: "contiguous" or "zigzag" (layout_rules.cp_layout)."""
        return cp_layout(self.cp_method)

    @property
    def dp_size(self) -> int:
        """Data-parallel degree: how many different slices of the global batch are read at once."""
        return self.dp_replicate * self.dp_shard

    def check_world(self, world_size: int) -> None:
        for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"):
            if getattr(self, name) < 1:
                raise ParallelError(f"{name}={getattr(self, name)} is invalid: must be >= 1")
        if self.world != world_size:
            raise ParallelError(
                f"pp={self.pp} x dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x "
                f"cp={self.cp} x tp={self.tp} = {self.world} ranks, but the world has {world_size}")

    # ---- validation against the model (no process group needed) ------------------------
    def validate(self, model_cfg: ModelConfig, world_size: int | None = None, seq_len: int | None = None,
                 vpp: int | None = None) -> None:
        """Refuse, with the dimension and both numbers, any size that the world or the model's
        shapes (heads, KV heads, experts, layers, vocabulary, FFN dims, sequence) cannot take, or
        a combination that is not supported (the rules: tessera.config.layout_rules). `vpp`
        defaults to this layout's own."""
        self.check_world(self.world_size if world_size is None else world_size)
        sizes = self if vpp is None else dataclasses.replace(self, vpp=vpp)
        problems = layout_problems(model_cfg, sizes, seq_len=seq_len)
        if problems:
            raise ParallelError(problems[0])

    # ---- the mesh ------------------------------------------------------------------------
    def build_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """Create the named mesh (the default process group must exist) and its flattened dims."""
        shape = tuple(getattr(self, d) if d in ("pp", "dp_replicate", "cp", "tp") else
                      (self.dp_shard_mod_ep if d == "dp_shard_mod_ep" else self.dp_shard_in_ep)
                      for d in BASE_DIMS)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=BASE_DIMS)
        self._meshes.flat = {flat: mesh[parts]._flatten(flat) for flat, parts in FLAT_DIMS.items()}
        self._meshes.base = mesh
        return mesh

    @property
    def mesh(self) -> DeviceMesh | None:
        """The named mesh of the base dimensions (None until `build_mesh`)."""
        return self._meshes.base

    @property
    def flat_meshes(self) -> dict[str, DeviceMesh]:
        """The flattened dimensions' meshes by name (empty until `build_mesh`)."""
        return self._meshes.flat

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        """The sub-mesh of one name ("tp", "dp", "ep", ...) or of several (outer to inner)."""
        if self.mesh is None:
            raise ParallelError("the device mesh is not built yet: call ParallelDims.build_mesh() first")
        names = (names,) if isinstance(names, str) else tuple(names)
        for n in names:
            self.size(n)  # refuses unknown names
        if all(n in BASE_DIMS for n in names):
            return self.mesh[names]
        if len(names) == 1:
            return self.flat_meshes[names[0]]
        parts = [self.flat_meshes[n] if n in FLAT_DIMS else self.mesh[n] for n in names]
        return DeviceMesh._concatenate(parts)

    def local_rank(self, name: str) -> int:
        """This rank's coordinate along a (base or flattened) dimension."""
        return self[name].get_local_rank()

    @property
    def dp_rank(self) -> int:
        """Which slice of the global batch this rank reads (equal across its tp, cp and pp peers)."""
        return self.local_rank("dp")

    def coordinates(self) -> dict[str, int]:
        """This rank's coordinate along every base dimension."""
        coords = self[BASE_DIMS].get_coordinate()
        return dict(zip(BASE_DIMS, coords))
