"""Transient memory per rank at real shapes (128k tokens, P=8, H32/KV8, D128, bf16), measured
on the meta device with torch's fake process group (``ulysses_sp.testing.memory``).

The bound is documented in docs/architecture.md ("Memory model"), in local shard bytes:
Q = this rank's q shard, KV = its k (or v) shard, G = one head chunk of full-length K and V
(all-gather). No term grows with S_q x S_k: doubling the sequence at most doubles the figures.
"""

import json
import subprocess
import sys

import pytest

BACKENDS = ("ulysses", "ulysses-g2", "ulysses-g4", "allgather", "ring", "hybrid")


def _measure(seq: int) -> dict:
    cmd = [sys.executable, "-m", "ulysses_sp.testing.memory", "--seq", str(seq), "--sp", "8", "--backends", ",".join(BACKENDS), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return {r["backend"]: r for r in json.loads(done.stdout.strip().splitlines()[-1])}


@pytest.fixture(scope="module")
def at_128k():
    return _measure(131072)


def bound(r: dict) -> tuple[int, int]:
    """(forward, backward) bytes allowed: c x (Q + 2 KV), plus for the all-gather its gathered chunks."""
    q, kv = r["q_shard_bytes"], r["kv_shard_bytes"]
    shards = q + 2 * kv
    if r["backend"].startswith("ulysses"):  # over head groups: one group's head shards (and the next one's in flight), fp32 dK/dV sums
        return 4.5 * shards, 4.5 * shards
    if r["backend"] == "allgather":  # gathered, put in global order, the next chunk's in flight; backward: fp32 dK/dV twice
        g = r["gathered_chunk_bytes"]
        return 4 * shards + 3 * g, 4 * shards + 6 * g
    return 8 * shards, 8 * shards


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.quick
def test_transient_memory_within_the_documented_bound(at_128k, backend):
    r = at_128k[backend]
    assert r["kernel"] == "torch", "the meta device takes the torch kernel's CUDA path"
    fwd, bwd = bound(r)
    assert 0 < r["forward_peak_bytes"] <= fwd, r
    assert 0 < r["backward_peak_bytes"] <= bwd, r


def test_no_quadratic_term(at_128k):
    """At 256k tokens every figure is at most twice the 128k one (a S_q x S_k term would be 4x)."""
    at_256k = _measure(262144)
    for backend in BACKENDS:
        for phase in ("forward_peak_bytes", "backward_peak_bytes"):
            assert at_256k[backend][phase] <= 2.01 * at_128k[backend][phase], (backend, phase)


def test_head_groups_lower_the_transient(at_128k):
    """Ulysses over 4 head groups (one q head a group here) holds no group's head shards beyond its turn and writes
    the gradients over its saved copies: both peaks fall well below plain Ulysses' (the results are equal:
    tests/test_parity.py's ulysses-g2 and g3 cases)."""
    plain, grouped = at_128k["ulysses"], at_128k["ulysses-g4"]
    for phase in ("forward_peak_bytes", "backward_peak_bytes"):
        assert plain[phase] >= at_128k["ulysses-g2"][phase] >= grouped[phase], f"{phase} must fall with the head groups"
    assert grouped["forward_peak_bytes"] < 0.8 * plain["forward_peak_bytes"], (grouped, plain)
    assert grouped["backward_peak_bytes"] < 0.7 * plain["backward_peak_bytes"], (grouped, plain)


def test_deepseek_sparse_attention_has_no_quadratic_term():
    """One DeepSeek-V3.2 attention layer under the indexed strategy, 64k and 128k tokens on 8 ranks: each rank's
    peaks at most double with the sequence (the indexer's scores and the attention over the chosen latents come in
    chunks of queries; a [S/P, S] term would quadruple them), and stay under 8 GiB at 128k."""
    code = "import json; from ulysses_sp.testing.memory import measure_indexed; print(json.dumps([measure_indexed(seq=s) for s in (65536, 131072)]))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)  # one process: one import
    assert done.returncode == 0, done.stderr[-3000:]
    figures = {r["seq"]: r for r in json.loads(done.stdout.strip().splitlines()[-1])}
    for phase in ("forward_peak_bytes", "backward_peak_bytes"):
        assert 0 < figures[131072][phase] <= 2.01 * figures[65536][phase], (phase, figures)
        assert figures[131072][phase] < 8 * 2**30, (phase, figures)


def test_deepseek_v4_attention_has_no_quadratic_term():
    """One DeepSeek-V4 compressed sparse attention layer under the compressed strategy, 32k and 64k tokens on 8 ranks: each
    rank's peaks at most double with the sequence (each block of queries scores its window's rows and the indexer's 512
    entries only; the indexer's own scores come in chunks of queries; no [S/P, S / 4] bias), under 4 GiB at 64k."""
    code = ("import json; from ulysses_sp.testing.memory import measure_compressed; "
            "print(json.dumps([measure_compressed(seq=s) for s in (32768, 65536)]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = {r["seq"]: r for r in json.loads(done.stdout.strip().splitlines()[-1])}
    for phase in ("forward_peak_bytes", "backward_peak_bytes"):
        assert 0 < figures[65536][phase] <= 2.01 * figures[32768][phase], (phase, figures)
        assert figures[65536][phase] < 4 * 2**30, (phase, figures)
