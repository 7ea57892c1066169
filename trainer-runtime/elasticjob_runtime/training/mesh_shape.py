"""The shape of a round's device mesh: how many replicas, each over how many ranks.

FSDP2 shards over a 1-D mesh of every rank. HSDP shards over a *shard group* and
replicates across groups: a 2-D ``(replicate, shard)`` mesh, rank ``r`` holding shard
``r % shard`` of replica ``r // shard`` (``init_device_mesh``'s row-major layout). The
script names the shard group size it wants; the world is whatever the round formed, and
need not be a multiple of it. The group size is a floor on memory, not a wish: a rank of
a smaller group holds a larger shard, which may not fit. So a round shards over the
smallest divisor of its world that is at least the size asked, and replicates over what
is left: a world of 4 with groups of 2 is 2 x 2, a world of 3 is one group of 3 (pure
FSDP until the fourth rank is back), a world of 6 is 3 x 2. Only a world smaller than
the group size shards over fewer ranks than asked (all of them), and says so.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MeshShape:
    """``replicas`` copies of the model, each sharded over ``shard`` ranks."""

    replicas: int
    shard: int

    @property
    def world(self) -> int:
        return self.replicas * self.shard

    def shard_index(self, rank: int) -> int:
        """Which shard ``rank`` holds: the same rows as every rank of that index."""
        return rank % self.shard


def mesh_shape(world: int, shard_group_size: int | None) -> MeshShape:
    """The mesh a round of ``world`` ranks uses; ``None`` shards over the whole world
    (FSDP2), a size asks for HSDP with shard groups of at least that many ranks."""
    if world < 1:
        raise ValueError(f"a round has at least one rank (got {world})")
    if shard_group_size is None:
        return MeshShape(1, world)
    if shard_group_size < 1:
        raise ValueError(f"shard_group_size must be 1 or more (got {shard_group_size})")
    shard = next((d for d in range(shard_group_size, world + 1) if world % d == 0), world)
    return MeshShape(world // shard, shard)


def shape_note(shape: MeshShape, shard_group_size: int | None) -> str | None:
    """What a user should hear about a round's shape, or None: a shard group that is
    not the size asked (its ranks hold larger shards than planned)."""
    if shard_group_size is None or shape.shard == shard_group_size:
        return None
    if shape.shard < shard_group_size:
        return (
            f"a round of {shape.world} ranks shards over all of them, fewer than the "
            f"shard_group_size={shard_group_size} asked: each holds 1/{shape.shard} of the model"
        )
    return (
        f"a round of {shape.world} ranks is not a multiple of shard_group_size="
        f"{shard_group_size}: it shards over {shape.shard} ranks x {shape.replicas} replica(s)"
    )
