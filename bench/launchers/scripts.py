"""Every training script the bench runs, by who it was written for."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# written for our Run (they run under torchrun too: the Run works under any launcher)
REGRESSION = REPO / "examples" / "train_regression.py"
GPT_RUN = REPO / "examples" / "train_gpt.py"
GPT_FSDP_RUN = REPO / "examples" / "train_gpt_fsdp.py"
# the same models written for torchrun alone, as a user would before converting
GPT_PLAIN = REPO / "bench" / "gpt_plain.py"
GPT_FSDP_PLAIN = REPO / "bench" / "gpt_fsdp_plain.py"
# an unchanged classic torchelastic script (its own checkpoints): the same under every launcher
CLASSIC = REPO / "bench" / "classic_imagenet.py"
# the regression model and the realistic script written the way torchft's docs and
# examples write a script
REGRESSION_TORCHFT = REPO / "bench" / "torchft_regression.py"
GPT_TORCHFT = REPO / "bench" / "torchft_gpt.py"
