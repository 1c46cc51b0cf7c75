"""``--docs SPEC``: the document lengths of a packed row, for ``sp-bench run`` and ``sp-bench plan``.

A SPEC is either

* a pattern of lengths, ``12k,512x8`` (12288 tokens, then eight of 512): repeated until the row
  is full; or
* ``lognormal:MEDIAN:SIGMA``, e.g. ``lognormal:2k:1.5``: lengths drawn from a log-normal
  distribution of that median and shape (at least one token each), seeded, so every rank and
  every run draws the same row.

Either way the last document is cut at the row's end. The result is the row's global document
boundaries, ``cu_seqlens`` (0, ..., seq_len).
"""

from __future__ import annotations

import math
import random

from .plan import parse_tokens

__all__ = ["parse_docs", "describe_docs"]


def parse_docs(text: str, seq_len: int, seed: int = 0) -> tuple[int, ...]:
    """The global document boundaries of a ``seq_len``-token row packed as ``text`` says."""
    text = str(text).strip().lower()
    if text.startswith("lognormal:"):
        try:
            _, median, sigma = text.split(":")
            mu, sigma = math.log(parse_tokens(median)), float(sigma)
        except ValueError:
            raise ValueError(f"{text!r}: expected lognormal:MEDIAN:SIGMA, e.g. lognormal:2k:1.5") from None
        if sigma < 0:
            raise ValueError(f"{text!r}: the log-normal sigma must be >= 0")
        rng = random.Random(seed)
        draw = lambda: max(1, round(rng.lognormvariate(mu, sigma)))  # noqa: E731
    else:
        pattern = []
        for item in text.split(","):
            length, _, count = item.strip().partition("x")
            try:
                pattern += [parse_tokens(length)] * (int(count) if count else 1)
            except ValueError as e:
                raise ValueError(f"--docs {text!r}: {e}; a pattern is lengths with optional counts, e.g. 12k,512x8") from None
        if not pattern:
            raise ValueError(f"--docs {text!r}: no document lengths")
        lengths = iter(pattern * (seq_len // sum(pattern) + 1))
        draw = lambda: next(lengths)  # noqa: E731
    bounds = [0]
    while bounds[-1] < seq_len:
        bounds.append(min(seq_len, bounds[-1] + draw()))
    return tuple(bounds)


def describe_docs(cu_seqlens) -> str:
    """``120 documents, 1 to 31744 tokens (median 640)``."""
    lengths = sorted(b - a for a, b in zip(cu_seqlens, cu_seqlens[1:]))
    if len(lengths) == 1:
        return f"1 document of {lengths[0]} tokens"
    return f"{len(lengths)} documents, {lengths[0]} to {lengths[-1]} tokens (median {lengths[len(lengths) // 2]})"
