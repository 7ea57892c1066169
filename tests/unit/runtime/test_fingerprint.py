"""Fingerprints tell equal training state from different state, and the rule names the
ranks that disagree."""

from __future__ import annotations

import torch
from torch import nn

from elasticjob_runtime.training.fingerprint import (
    as_signed,
    bit_sum,
    disagreements,
    disagreements_within,
    divergence_message,
    fingerprint,
    tensor_fingerprint,
    value_fingerprint,
)


def test_equal_tensors_agree_and_a_one_ulp_change_does_not() -> None:
    a = torch.randn(1000)
    b = a.clone()
    assert tensor_fingerprint(a) == tensor_fingerprint(b)
    b[500] = torch.nextafter(b[500], torch.tensor(float("inf")))
    assert tensor_fingerprint(a) != tensor_fingerprint(b)


def test_dtype_and_shape_are_part_of_a_tensor_fingerprint() -> None:
    zeros = torch.zeros(4, 4)
    assert tensor_fingerprint(zeros) != tensor_fingerprint(zeros.reshape(16))
    assert tensor_fingerprint(zeros) != tensor_fingerprint(zeros.to(torch.float64))
    assert tensor_fingerprint(zeros) != tensor_fingerprint(zeros.to(torch.bfloat16))
    for dtype in (torch.bool, torch.uint8, torch.int16, torch.int64, torch.complex64):
        tensor_fingerprint(torch.ones(3, dtype=dtype))  # every width has a reading
    assert tensor_fingerprint(torch.zeros(0)) == tensor_fingerprint(torch.zeros(0))


def test_the_bit_sum_is_torchs_widening_sum_exactly_and_adds_up_across_shards() -> None:
    """The CPU path sums through numpy (torch's widening sum is slow); the value must be
    the one torch's gives, for every width, for strided views, and split anywhere."""
    torch.manual_seed(0)
    cases = [
        torch.randn(1001) * 1e30,  # large bit patterns, both signs
        torch.randn(33, 17).t(),  # strided
        torch.randn(257).to(torch.bfloat16),
        torch.randn(257).to(torch.float16),
        torch.randint(0, 256, (300,), dtype=torch.uint8),
        torch.rand(300) > 0.5,
        torch.randn(64, dtype=torch.complex64),
        torch.randn(129, dtype=torch.float64),
    ]
    for t in cases:
        ints = (torch.view_as_real(t) if t.is_complex() else t).contiguous()
        ints = ints.view(
            {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[ints.element_size()]
        )
        assert bit_sum(t).item() == ints.sum(dtype=torch.int64).item(), t.dtype
        flat = t.reshape(-1)
        assert (bit_sum(flat[:37]) + bit_sum(flat[37:])).item() == bit_sum(t).item()


def test_a_module_is_its_parameters_and_not_its_buffers() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    before = fingerprint(net)
    net(torch.randn(8, 4))  # training-mode BatchNorm updates its running statistics
    assert fingerprint(net) == before
    with torch.no_grad():
        net[0].weight[0, 0] += 1
    assert fingerprint(net) != before


def test_an_optimizer_differs_when_its_learning_rate_does() -> None:
    params = [nn.Parameter(torch.ones(3))]
    one, two = torch.optim.AdamW(params, lr=1e-3), torch.optim.AdamW(params, lr=1e-3)
    assert fingerprint(one) == fingerprint(two)
    two.param_groups[0]["lr"] = 2e-3
    assert fingerprint(one) != fingerprint(two)


def test_plain_values_and_containers() -> None:
    assert value_fingerprint({"a": 1, "b": 2.5}) == value_fingerprint({"b": 2.5, "a": 1})
    assert value_fingerprint([1, 2]) != value_fingerprint([2, 1])
    assert value_fingerprint(1) != value_fingerprint(1.0)
    assert value_fingerprint(True) != value_fingerprint(1)
    assert value_fingerprint(None) != value_fingerprint(0)
    assert value_fingerprint("lr") == value_fingerprint("lr")
    assert value_fingerprint(2**70) != value_fingerprint(2**70 + 1)
    assert -(2**63) <= as_signed(2**64 - 1) < 2**63


def test_disagreements_group_the_ranks_majority_first() -> None:
    names = ["model", "optim", "scheduler"]
    rows = [[1, 5, 9], [1, 5, 8], [1, 5, 9], [1, 6, 9]]
    found = disagreements(names, rows)
    assert [d.name for d in found] == ["optim", "scheduler"]
    assert found[0].groups == ((0, 1, 2), (3,))
    assert found[1].groups == ((0, 2, 3), (1,))
    assert disagreements(names, [[1, 5, 9], [1, 5, 9]]) == []


def test_the_message_is_one_line_naming_what_differs_and_how_to_fix_it() -> None:
    found = disagreements(["optim"], [[1], [2]])
    line = divergence_message(31, "the first step after the group formed", found)
    assert "\n" not in line
    assert "at step 31" in line and "'optim' differs (ranks [0] vs [1])" in line
    assert "run.wrap(..., state=" in line


def test_sets_and_objects_with_addresses_fingerprint_alike_in_every_process() -> None:
    import os
    import subprocess
    import sys

    code = (
        "from elasticjob_runtime.training.fingerprint import value_fingerprint as f\n"
        "class Thing: pass\n"
        "print(f({'a', 'b', 'c', 'd'}), f([Thing()]))"
    )
    runs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
        ).stdout
        for seed in (1, 2, 3)
    }
    assert len(runs) == 1, runs


def test_hsdp_replicas_are_compared_within_their_shard_never_across() -> None:
    # ranks 0 1 / 2 3 of a 2 x 2 mesh: ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1
    cohorts = [0, 1, 0, 1]
    assert disagreements_within(["shards"], cohorts, [[10], [20], [10], [20]]) == []
    (found,) = disagreements_within(["shards"], cohorts, [[10], [20], [10], [21]])
    assert (found.name, found.shard) == ("shards of shard 1", 1)
    assert set(found.groups) == {(1,), (3,)}  # the ranks' own numbers, not their places
    line = divergence_message(6, "checked every 3 steps", [found])
    assert "'shards of shard 1' differs (ranks [1] vs [3]). HSDP replicas" in line
    assert "run.wrap(" not in line  # the DDP advice does not fit
