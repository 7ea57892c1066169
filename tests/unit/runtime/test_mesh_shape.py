"""The mesh a round gets (training/mesh_shape.py): never smaller shard groups than the
script asked for while the world allows it, since a smaller group means larger shards."""

from __future__ import annotations

import pytest

from elasticjob_runtime.training.mesh_shape import MeshShape, mesh_shape, shape_note


@pytest.mark.parametrize(
    ("world", "asked", "shape"),
    [
        (4, None, MeshShape(1, 4)),  # FSDP2: one group of every rank
        (4, 2, MeshShape(2, 2)),
        (3, 2, MeshShape(1, 3)),  # not a multiple: one larger group, until the 4th is back
        (6, 2, MeshShape(3, 2)),
        (6, 4, MeshShape(1, 6)),
        (8, 3, MeshShape(2, 4)),
        (1, 2, MeshShape(1, 1)),  # fewer ranks than a group: all of them
        (5, 1, MeshShape(5, 1)),  # groups of one: every rank holds the whole model
    ],
)
def test_a_round_shards_over_the_smallest_divisor_of_its_world_at_least_the_size_asked(
    world: int, asked: int | None, shape: MeshShape
) -> None:
    got = mesh_shape(world, asked)
    assert got == shape
    assert got.world == world
    if asked is not None and world >= asked:
        assert got.shard >= asked


def test_a_rank_holds_the_shard_of_its_column_in_the_row_major_mesh() -> None:
    shape = MeshShape(2, 3)  # ranks 0 1 2 / 3 4 5
    assert [shape.shard_index(r) for r in range(6)] == [0, 1, 2, 0, 1, 2]


def test_a_shape_other_than_asked_is_said_and_a_bad_size_named() -> None:
    assert shape_note(MeshShape(2, 2), 2) is None
    assert shape_note(MeshShape(1, 4), None) is None
    assert "not a multiple of shard_group_size=2" in (shape_note(MeshShape(1, 3), 2) or "")
    assert "fewer than the shard_group_size=2" in (shape_note(MeshShape(1, 1), 2) or "")
    with pytest.raises(ValueError, match="shard_group_size must be 1 or more"):
        mesh_shape(4, 0)
