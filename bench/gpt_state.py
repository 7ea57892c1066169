"""The realistic example's training state as the cost probes measure it: its model,
AdamW and EMA at the example's own sizes (``examples/train_gpt.py``), 53 MB."""

from __future__ import annotations

import importlib
from typing import Any


def realistic_state(trained: bool) -> dict[str, Any]:
    """The model, AdamW and the EMA; ``trained``: after one step, as a survivor holds
    them (AdamW's moments exist), else as a new worker builds them (AdamW empty)."""
    import torch
    from torch import nn
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    gpt = importlib.import_module("elasticjob_examples.train_gpt")
    a = gpt.parse_args([])  # the example's own sizes
    torch.manual_seed(0)
    model = gpt.GPT(a.vocab, a.seq, a.dim, a.layers, a.heads)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99))  # type: ignore[no-untyped-call]
    if trained:
        data = gpt.Sequences(a.batch_size, a.seq, a.vocab)
        inputs, targets = (torch.stack([data[i][j] for i in range(a.batch_size)]) for j in (0, 1))
        nn.CrossEntropyLoss()(model(inputs).flatten(0, 1), targets.flatten()).backward()
        optim.step()
        ema.update_parameters(model)
    return {"model": model, "optim": optim, "ema": ema}
