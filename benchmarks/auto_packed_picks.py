"""auto's pick on packed rows left under zigzag, with its work term (the slowest rank's work over
the mean scaling the compute of the backends that split by chunks) and without it (as before the
term existed), and under balanced. No ranks: the estimates of ``sp-bench plan``, on the built-in
CPU profiles for the rows ``packed_balance.py`` times and on the NVLink profile at 128k.

    python benchmarks/auto_packed_picks.py
"""

from __future__ import annotations

from unittest import mock

import torch

from ulysses_sp.cli.docs import parse_docs
from ulysses_sp.cli.plan import LayerShape, plan_rows
from ulysses_sp.profile import CPU_GLOO_PROFILE, CPU_GLOO_PROFILE_P4, NVLINK_PROFILE
from ulysses_sp.spec import AttnSpec


def pick(shape, seq, p, lay, cu, profile, dtype) -> str:
    """The chosen backend, its estimate and the runner-up's margin."""
    (_, _, _, chosen, considered), = plan_rows([shape], seq_len=seq, sp_size=p, layout=lay, profile=profile, cu_seqlens=cu, dtype=dtype)
    times = sorted(e.seconds for e in considered.values() if hasattr(e, "seconds"))
    return f"{chosen} ({considered[chosen].seconds * 1e3:.0f} ms, next +{(times[1] / times[0] - 1) * 100:.0f}%)"


def main() -> None:
    cases = []
    for seq in (8192, 16384):
        for p, profile in ((2, CPU_GLOO_PROFILE), (4, CPU_GLOO_PROFILE_P4)):
            for h, kv in ((8, 8), (8, 2), (16, 1)):
                cases.append((f"{seq // 1024}k, one 3/4 document then 512-token ones ({profile.name})", LayerShape(h, kv, 64), seq, p,
                              parse_docs(f"{3 * seq // 4},512x{seq // 4 // 512}", seq), profile, torch.float32))
    for p in (8, 16):
        for h, kv in ((32, 8), (8, 8)):
            cases.append(("128k, lognormal:2k:1.5 seed 0 (nvlink, bf16)", LayerShape(h, kv, 128), 131072, p,
                          parse_docs("lognormal:2k:1.5", 131072), NVLINK_PROFILE, torch.bfloat16))
    print("| row | P | heads q/kv x D | zigzag, without the work term | zigzag | balanced |")
    print("|---|---|---|---|---|---|")
    for name, shape, seq, p, cu, profile, dtype in cases:
        with mock.patch.object(AttnSpec, "work_imbalance", lambda self, table: 1.0):
            before = pick(shape, seq, p, "zigzag", cu, profile, dtype)
        after, balanced = (pick(shape, seq, p, lay, cu, profile, dtype) for lay in ("zigzag", "balanced"))
        print(f"| {name} | {p} | {shape.q_heads}/{shape.kv_heads} x {shape.head_dim} | {before} | {after} | {balanced} |", flush=True)


if __name__ == "__main__":
    main()
