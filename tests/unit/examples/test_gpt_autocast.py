"""The realistic script's ``--autocast auto`` takes bf16 only where the CPU has it: a CPU
without AVX512-BF16 or AMX emulates bf16 about 13x slower than fp32 (measured on an AVX2
EPYC), which made every realistic bench figure there a measure of the emulation."""

from __future__ import annotations

from pathlib import Path

import torch
from elasticjob_examples.train_gpt import cpu_has_bf16, use_bf16  # type: ignore[import-not-found]

AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
SAPPHIRE = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"


def test_bf16_flags_are_read_from_the_kernel(tmp_path: Path) -> None:
    (tmp_path / "avx2").write_text(AVX2)
    (tmp_path / "spr").write_text(SAPPHIRE)
    assert not cpu_has_bf16(str(tmp_path / "avx2"))
    assert cpu_has_bf16(str(tmp_path / "spr"))
    assert not cpu_has_bf16(str(tmp_path / "missing"))


def test_explicit_choices_win_over_the_hardware() -> None:
    cpu = torch.device("cpu")
    assert use_bf16("bf16", cpu)
    assert not use_bf16("off", cpu)
    assert use_bf16("auto", cpu) == cpu_has_bf16()
