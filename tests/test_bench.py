"""``sp-bench run``: a tiny grid on 2 spawned ranks; the outputs' schema, never timings."""

import csv
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from ulysses_sp.cli.bench import BASELINE, Cell, summarise
from ulysses_sp.cli.main import main as sp_bench
from ulysses_sp.cli.report import CSV_COLUMNS
from ulysses_sp.profile import load_profile

from .conftest import values

BACKENDS = ["ulysses", "allgather", "ring", "hybrid", "halo", "auto"]
PEERS = ["peer:deepspeed", "peer:torch-ring", "peer:ring-flash-attn", "peer:yunchang"]


pytestmark = pytest.mark.usefixtures("pooled_spawns")


@pytest.fixture(scope="module")
def bench(tmp_path_factory, pooled_spawns):
    out = tmp_path_factory.mktemp("bench")
    args = ["run", "--nproc", "2", "--seq", "64,128", "--heads", "4", "--kv-heads", "2,q", "--head-dim", "8", "--window", "none,16",
            "--warmup", "0", "--repeat", "2", "--peers", "--check",
            "--json", str(out / "b.json"), "--csv", str(out / "b.csv"), "--plot", str(out / "b.png")]
    result = CliRunner().invoke(sp_bench, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out, result.output, json.loads((out / "b.json").read_text())


def test_every_backend_and_peer_has_a_row_per_cell(bench):
    _, output, data = bench
    rows = data["rows"]
    cells = {(r["seq"], r["kv_heads"], r["window"]) for r in rows}
    assert cells == {(s, kv, w) for s in (64, 128) for kv in (2, 4) for w in (None, 16)}
    for cell in cells:
        assert sorted(r["entry"] for r in rows if (r["seq"], r["kv_heads"], r["window"]) == cell) == sorted(BACKENDS + PEERS)
    for r in rows:
        if r["entry"] == "halo" and r["window"] is None:
            assert r["skipped"].startswith("halo: only for sliding-window layers"), r
        elif r["kind"] == "ulysses-sp":
            assert "skipped" not in r, r
            assert r["fwd_s"]["min"] <= r["fwd_s"]["median"] <= r["fwd_s"]["max"]
            assert len(r["fwd_bwd_s_all"]) == 2 and r["fwd_bwd_s"]["median"] > r["fwd_s"]["median"] > 0
            assert r["bytes_match"] and r["fwd_bytes_sent"] == r["analytic_fwd_bytes"] > 0
            assert r["bwd_bytes_sent"] == r["analytic_bwd_bytes"] > 0
            # the growth of the resident set over the call: measured (an int) for every row, 0 where a tiny call
            # fit in pages already held, and above 0 somewhere in the grid
            assert r["max_error"] < 1e-5 and r["efficiency"] > 0 and isinstance(r["peak_mem_bytes"], int) and r["peak_mem_bytes"] >= 0
    assert max(r["peak_mem_bytes"] for r in rows if r["kind"] == "ulysses-sp" and "skipped" not in r) > 0
    auto = [r for r in rows if r["entry"] == "auto"]
    assert all(r["resolved"] in BACKENDS for r in auto)


def test_peers_run_or_say_why(bench):
    _, output, data = bench
    for r in data["rows"]:
        if r["kind"] == "peer" and r["window"]:
            assert r["skipped"] == "peers are run without a sliding window", r
        elif r["entry"] in ("peer:deepspeed", "peer:torch-ring"):  # both run on CPU/gloo
            assert "skipped" not in r and r["max_error"] < 1e-5, r
        elif r["kind"] == "peer":  # fp32 on CPU without the fake: flash-attn's peers say why not
            assert "not installed" in r["skipped"] or "flash-attn" in r["skipped"], r
            assert f"skipped {r['entry']} ({r['layout']}) at S={r['seq']}" in output


def test_deepspeed_peer_says_why_not_for_fewer_kv_heads_than_ranks():
    """DeepSpeed's DistributedAttention asserts kv heads >= sp size in its first call (a crash of
    the whole run, seen at H16/KV1 on 2 ranks); the peer now says so before running."""
    from types import SimpleNamespace

    from ulysses_sp.cli.peers import PEERS as PEER_CLASSES

    cell, topo = SimpleNamespace(heads=16, kv_heads=1), SimpleNamespace(sp_size=2)
    assert PEER_CLASSES["deepspeed"].problem(cell, topo) == "DeepSpeed's DistributedAttention needs at least sp_size (2) KV heads, got 1"


def test_peers_on_the_fake_flash_attn(tmp_path):
    """--fake-flash-attn: ring-flash-attn and yunchang run on CPU on the same kernel as our
    backends (--kernel flash_attn), with their parity checked against fp64 attention; with
    --no-memory no peak memory is reported, and the environment says so."""
    args = ["run", "--nproc", "2", "--seq", "128,256", "--heads", "4", "--kv-heads", "4", "--head-dim", "16", "--dtype", "bfloat16",
            "--warmup", "0", "--repeat", "1", "--peers", "--check", "--fake-flash-attn", "--kernel", "flash_attn", "--no-baseline",
            "--no-memory", "--json", str(tmp_path / "b.json")]
    result = CliRunner().invoke(sp_bench, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "b.json").read_text())
    rows = data["rows"]
    assert data["env"]["memory"] == "not measured (--no-memory)"
    assert all(r["peak_mem_bytes"] is None for r in rows if "skipped" not in r)
    assert sorted(r["entry"] for r in rows) == sorted(2 * (BACKENDS + PEERS))
    for r in rows:
        if r["entry"] == "halo":  # full attention: halo says why not
            assert r["skipped"].startswith("halo: only for sliding-window layers"), r
            continue
        assert "skipped" not in r, r
        assert r["max_error"] < 3e-2, r  # bf16 inputs against fp64 attention


def test_cells_with_attention_sinks(tmp_path):
    """--sinks: every backend (halo on the windowed cells) against fp64 attention with the same sinks, on the
    flash_attn kernel's CPU fake in bf16, with the bytes estimate() gives; the peers say why not."""
    args = ["run", "--nproc", "2", "--seq", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--dtype", "bfloat16", "--window", "none,16",
            "--sinks", "--warmup", "0", "--repeat", "1", "--peers", "--check", "--fake-flash-attn", "--kernel", "flash_attn", "--no-baseline",
            "--no-memory", "--json", str(tmp_path / "b.json")]
    result = CliRunner().invoke(sp_bench, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "learned sinks" in result.output
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert {r["window"] for r in rows} == {None, 16} and all(r["sinks"] for r in rows)
    for r in rows:
        if r["kind"] == "peer":
            assert r["skipped"] in ("peers are run without attention sinks", "peers are run without a sliding window"), r
        elif r["entry"] == "halo" and r["window"] is None:
            assert r["skipped"].startswith("halo: only for sliding-window layers"), r
        else:
            assert "skipped" not in r and r["max_error"] < 3e-2 and r["bytes_match"], r


def test_environment_csv_and_plot(bench):
    out, _, data = bench
    env = data["env"]
    assert env["world_size"] == 2 and env["threads_per_rank"] == 1 and env["process_group"] == "gloo"
    assert {"torch", "date", "command", "device", "memory", "timing"} <= set(env)
    assert "separate group of ranks run with MALLOC_MMAP_THRESHOLD_=131072" in env["memory"]  # the timed ranks ran without it
    assert "MALLOC_MMAP_THRESHOLD_" not in os.environ
    lines = (out / "b.csv").read_text().splitlines()
    assert lines[0].startswith("# ")
    table = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    assert list(table[0]) == CSV_COLUMNS and len(table) == len(data["rows"])
    assert (out / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_entries_run_in_rotating_rounds(ranks):
    """Run i of every entry of a cell ran in round i, so that a ratio taken round by round
    (grid_table.py) pairs calls made one after the other, whatever the machine's drift."""
    names = ["peer:a", "peer:b", "peer:c", "T1"]
    rounds = [names[i:] + names[:i] for i in range(4)]
    for rank, r in enumerate(values(ranks(2), "bench/rounds")):
        assert r["calls"] == names + sum(rounds, [])
        assert r["skipped"] == {"peer:skip": "cannot run"}
        for name in names:  # call numbers of its runs: the 4 warmups, then 4 per round; T1's are rank 0's alone
            expected = [5 + 4 * i + rounds[i].index(name) for i in range(4)]
            assert r["runs"][BASELINE if name == "T1" else name] == (expected if rank == 0 or name != "T1" else [None] * 4)
        assert r["nothing_runs"] == {(0, "peer:skip"): {"skipped": "cannot run"}}  # a cell no entry can run, T1 left out too


def test_efficiency_is_paired_by_round():
    """T1 / (P x T) is taken round by round (T from the slowest rank) and its median reported, not
    the ratio of the medians: here 0.75 against 0.5 / (2 x 0.4) = 0.625."""
    cell = Cell(8, 2, 2, 4, 1, "float32", True, "zigzag")
    run = lambda total: (0.0, total, 0, 0, 0)  # noqa: E731
    per_rank = [{(0, "ring"): {"runs": [run(0.2), run(0.4), run(0.6)]}, (0, BASELINE): {"runs": [0.3, 0.5, 0.9]}},
                {(0, "ring"): {"runs": [run(0.1), run(0.3), run(0.6)]}, (0, BASELINE): {"runs": [None] * 3}}]
    (row,) = summarise([cell], ["ring"], per_rank, 2)
    assert row["t1_s"] == 0.5 and row["fwd_bwd_s"]["median"] == 0.4
    assert row["efficiency"] == pytest.approx(0.75)  # rounds: 0.75, 0.625, 0.75
    (row,) = summarise([cell], ["ring"], [{k: v for k, v in r.items() if k[1] != BASELINE} for r in per_rank], 2)
    assert "efficiency" not in row and "t1_s" not in row


@pytest.mark.quick
def test_bad_grid_is_a_usage_error():
    for args, message in ((["--backends", "ringg"], "unknown backend 'ringg'"), (["--peers", "megatron"], "unknown peer"),
                          (["--seq", "4q"], "not a token count"), (["--dtype", "float8"], "float32, bfloat16, float16"),
                          (["--seq", "100", "--nproc", "3"], "every length must divide by 6"), (["--kv-heads", "x"], "integers or q"),
                          (["--repeat", "0"], "0 is not in the range x>=1")):
        result = CliRunner().invoke(sp_bench, ["run", *args])
        assert result.exit_code == 2 and message in result.output, result.output


def test_calibrate_needs_two_ranks(monkeypatch):
    """One rank has no collective to time: a usage error, spawned or launched, before any rank starts."""
    result = CliRunner().invoke(sp_bench, ["calibrate", "--nproc", "1"])
    assert result.exit_code == 2 and "--nproc must be at least 2" in result.output, result.output
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    result = CliRunner().invoke(sp_bench, ["calibrate"])
    assert result.exit_code == 2 and "launch at least 2 ranks" in result.output, result.output


def test_calibrate_under_torchrun_uses_the_launch_ranks(tmp_path):
    """The launched path gpu_check.sh runs on NCCL (``_join_launch``: bind the rank's device, join
    the launcher's group), here on 2 gloo CPU ranks: the profile is written once and says 2 ranks."""
    out = tmp_path / "p.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "ulysses_sp.cli.main",
           "calibrate", "--repeat", "1", "--seq", "256", "--backend-seq", "512", "--out", str(out)]
    done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert done.stdout.count("wrote ") == 1
    profile = load_profile(str(out))
    assert profile.measured["world_size"] == 2 and set(profile.backend_overhead) == {"ulysses", "allgather", "ring", "halo"}


def test_packed_rows_under_each_layout(tmp_path):
    """``--docs`` packs every cell's row (one 80-token document, then 8-token ones) and ``--layout``
    takes several: every backend is right on it under each layout (fp32 against fp64, as --check
    says), sends what its estimate says, and each row names its layout's work imbalance; the
    peers, which run one document per row, say so."""
    from ulysses_sp.layout import chunk_table, table_imbalance

    out = tmp_path / "b.json"
    args = ["run", "--nproc", "2", "--seq", "128", "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--window", "none,16",
            "--docs", "80,8x6", "--layout", "zigzag,balanced", "--peers", "torch-ring", "--warmup", "0", "--repeat", "1", "--check",
            "--no-memory", "--no-baseline", "--json", str(out)]
    result = CliRunner().invoke(sp_bench, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    cu = (0, 80, *range(88, 129, 8))
    assert {(r["layout"], r["window"]) for r in rows} == {(lay, w) for lay in ("zigzag", "balanced") for w in (None, 16)}
    for r in rows:
        assert r["docs"] == "80,8x6" and tuple(r["cu_seqlens"]) == cu
        want = table_imbalance(chunk_table(r["layout"], 2, 128, cu), 128, cu, window=r["window"])
        assert r["work_imbalance"] == pytest.approx(want, abs=1e-12), r
        if r["entry"] == "peer:torch-ring":
            assert r["skipped"] == "peers are run without a sliding window" if r["window"] else "peers are run on one document per row", r
        elif "skipped" not in r:
            assert r["max_error"] < 1e-5 and r["bytes_match"], r
    assert sum("skipped" not in r for r in rows) == 4 * 5 + 2  # five entries per cell, and halo on the two windowed ones
    zigzag = [r["work_imbalance"] for r in rows if r["layout"] == "zigzag" and r["window"] is None]
    assert min(zigzag) > 1.3 and max(r["work_imbalance"] for r in rows if r["layout"] == "balanced") < 1.1
    assert "work: the slowest rank's attention work over the mean" in result.output


def test_run_under_torchrun_uses_the_launch_ranks(tmp_path):
    """``torchrun -m ulysses_sp.cli.main run`` (README; on NCCL gpu_check.sh's bench_nccl) on 2 gloo CPU ranks: rank 0
    writes the report once, with T1 timed in the rounds (an efficiency per row) and the memory
    measured in the timed calls themselves."""
    out = tmp_path / "b.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "ulysses_sp.cli.main",
           "run", "--seq", "256", "--heads", "4", "--head-dim", "8", "--backends", "ulysses,ring", "--warmup", "0", "--repeat", "2",
           "--check", "--json", str(out)]
    done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert done.stdout.count("wrote ") == 1
    data = json.loads(out.read_text())
    assert data["env"]["world_size"] == 2 and "T1 ran on rank 0" in data["env"]["timing"]
    assert [r["entry"] for r in data["rows"]] == ["ulysses", "ring"]
    for r in data["rows"]:
        assert r["efficiency"] > 0 and r["t1_s"] > 0 and r["max_error"] < 1e-5 and isinstance(r["peak_mem_bytes"], int), r


def test_calibrate_writes_a_profile_auto_can_use(tmp_path):
    """``sp-bench calibrate`` at tiny sizes on 4 ranks: every figure present and finite, per-byte
    overheads of both kinds for every backend auto weighs there (the hybrid as ``hybrid-u2``), finite
    for those fitted on full attention (halo's is relative to the leanest of them on a window),
    and the profile loads back."""
    out = tmp_path / "p.json"
    args = ["calibrate", "--nproc", "4", "--repeat", "1", "--seq", "256", "--backend-seq", "512", "--out", str(out)]
    result = CliRunner().invoke(sp_bench, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    profile = load_profile(str(out))
    full = {"ulysses", "allgather", "ring", "hybrid-u2"}
    assert set(profile.backend_overhead) == set(profile.backend_overhead_kv) == full | {"halo"}
    # clamped at 0 by construction, so only finiteness can fail here
    assert all(math.isfinite(profile.backend_overhead[n]) and math.isfinite(profile.backend_overhead_kv[n]) for n in full)
    assert set(profile.measured["backends"]) >= {"8/8", "16/1", "windowed"}
    assert profile.ulysses_head_groups in (1, 2, 4) and profile.attention_bwd_flops["bfloat16"] > 0


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="the mixer layers are transformers'")
def test_mixers_times_every_strategy_that_can_run_each_layer(tmp_path):
    """sp-bench mixers on 2 ranks at 256 tokens: a row per layer; the short convolution under halo,
    allgather and state (its halo), Mamba2 under ulysses, allgather and state; bytes rank 0 sends, forward and backward,
    by hand: halo, the 2 tokens before rank 1's first chunk and the gradient of the 2 it received;
    ulysses, half of x, B and C (its one group sent to both ranks) and dt, and of the float32
    output, each way; allgather, the local input each way; state, each of its 2 zigzag fragments'
    summary (8 heads of [64, 64 + 64]) and convolution tail (3 tokens of x, B, C), each way."""
    out = tmp_path / "mixers.json"
    result = CliRunner().invoke(sp_bench, ["mixers", "--mixers", "conv,mamba2", "--seq", "256", "--nproc", "2", "--repeat", "1",
                                           "--json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = {r["mixer"]: r for r in json.loads(out.read_text())}
    local, fp32 = 128 * 256 * 4, 4
    halo = 2 * 2 * 256 * fp32  # state runs a short convolution as halo does
    assert {k: v["bytes_sent"] for k, v in rows["conv"]["strategies"].items()} == {"halo": halo, "allgather": 2 * local, "state": halo}
    per_token = (512 + 2 * 2 * 64 + 8) * fp32 + 512 * fp32
    state = 2 * 2 * (8 * 64 * (64 + 64) + 3 * (512 + 2 * 64)) * fp32
    assert ({k: v["bytes_sent"] for k, v in rows["mamba2"]["strategies"].items()}
            == {"ulysses": 2 * 128 * per_token // 2, "allgather": 2 * local, "state": state})
    assert all(v["seconds"] > 0 for r in rows.values() for v in r["strategies"].values()), rows
    assert "| conv | 256 | 2 |" in result.output and "| mamba2 | 256 | 2 |" in result.output, result.output
