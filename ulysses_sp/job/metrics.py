"""What the job reports per step: a JSON-lines file (rank 0) and a FLOPs-utilisation estimate."""

from __future__ import annotations

import json
import math
import os
import time

import torch

from .checkpoint import write_atomically

__all__ = ["MetricsFile", "count_params", "flops_per_token", "peak_tflops"]

PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0, "A10G": 70.0, "L4": 121.0}
"""Dense bf16/fp16 tensor-core peaks (TFLOP/s, NVIDIA datasheets; H100/H200: SXM) by device-name substring."""


def peak_tflops(device: torch.device, dtype: str, given: float | None) -> float | None:
    """The per-device peak the utilisation is measured against: ``given``, else a known
    GPU's bf16/fp16 peak; None (no estimate) on CPU or an unknown device."""
    if given is not None:
        return given
    if device.type != "cuda" or dtype == "fp32":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


def count_params(model) -> int:
    """Parameters that take part in matmuls: all but the input embeddings (a lookup), counting
    a tied LM head once. ZeRO-3 partitions report their full size (``ds_numel``)."""
    embed = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = head is not None and getattr(head, "weight", None) is embed
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p is not embed or tied)


def flops_per_token(model_config, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6 per parameter, plus causal attention's
    scores and weighted sum, 6 x layers x heads x head_dim x seq_len (half of the full 12,
    since a token sees on average half the sequence; sliding windows not taken off)."""
    heads = model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    return 6.0 * n_params + 6.0 * model_config.num_hidden_layers * heads * head_dim * seq_len


class MetricsFile:
    """One JSON object per line (rank 0 only; None path: nothing). A fresh run moves an existing
    file aside (``PATH.1``, ``PATH.2``, ...: the first free) and starts anew; a resumed one keeps
    the lines through its checkpoint's step (the steps after it run again), so no step appears
    twice. Non-finite numbers are written as null: strict JSON."""

    def __init__(self, path: str | None, enabled: bool, keep_through: int | None = None):
        self.path = path if enabled else None
        self.start = time.time()
        if not self.path:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        kept = []
        if keep_through is None and os.path.exists(self.path) and os.path.getsize(self.path):
            n = 1
            while os.path.exists(f"{self.path}.{n}"):
                n += 1
            os.replace(self.path, f"{self.path}.{n}")
        elif keep_through is not None and os.path.exists(self.path):
            with open(self.path) as f:
                for line in f:
                    try:
                        step = json.loads(line).get("step", 0)
                    except ValueError:  # a line cut by a crash
                        continue
                    if step <= keep_through:
                        kept.append(line.rstrip("\n") + "\n")
        write_atomically(self.path, "".join(kept))

    def write(self, **record) -> None:
        if self.path:
            record = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
            with open(self.path, "a") as f:
                f.write(json.dumps({**record, "time_s": round(time.time() - self.start, 3)}, allow_nan=False) + "\n")
