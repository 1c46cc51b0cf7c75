"""The auto policy, profiles and `sp-bench plan` (no ranks needed)."""

import importlib.util
import itertools
import json

import pytest
import torch
from click.testing import CliRunner

import ulysses_sp as usp
from ulysses_sp.models.switch import _backend_per_layer
from ulysses_sp.profile import COLLECTIVES, CPU_GLOO_PROFILE, CPU_GLOO_PROFILE_P4, NVLINK_PROFILE, LinkCost, Profile, default_profile
from ulysses_sp.registry import choose_backend, get_backend
from ulysses_sp.spec import AttnSpec, Estimate, MixerEstimate
from ulysses_sp.topology import HybridGroups, Topology

from ulysses_sp.cli.calibrate import _excess_over, _fit
from ulysses_sp.cli.main import main as sp_bench
from ulysses_sp.cli.plan import LayerShape, layers_from_config, plan_rows

from .conftest import values



def spec(hq, hkv, seq, p, d=64, dtype=torch.bfloat16):
    return AttnSpec(batch=1, seq_len=seq, local_seq_len=seq // p, q_heads=hq, kv_heads=hkv, head_dim=d, dtype=dtype,
                    causal=True, softmax_scale=d**-0.5, layout="zigzag")


@pytest.mark.parametrize("profile", [CPU_GLOO_PROFILE, CPU_GLOO_PROFILE_P4, NVLINK_PROFILE])
@pytest.mark.quick
def test_infeasible_backends_are_never_chosen(profile):
    for p, ud in [(2, None), (3, None), (4, 2), (8, 8), (64, 8), (64, 1)]:
        topo = Topology.for_planning(p, ulysses_degree=ud, ranks_per_node=8)
        for hq, hkv in [(4, 1), (6, 3), (8, 2), (32, 8), (40, 8), (12, 12)]:
            chosen, considered = choose_backend(spec(hq, hkv, 64 * p * 2, p), topo, profile)
            assert chosen.check(spec(hq, hkv, 64 * p * 2, p), topo) is None
            assert isinstance(considered[chosen.name], Estimate)
            for name, what in considered.items():
                assert isinstance(what, Estimate) or what.startswith(f"{name}: ")


def test_memory_budget_drops_backends_with_a_reason():
    topo = Topology.for_planning(4)
    s = spec(8, 2, 1 << 16, 4)
    _, considered = choose_backend(s, topo, NVLINK_PROFILE)
    gather_peak = considered["allgather"].peak_bytes
    tight = Profile(**{**NVLINK_PROFILE.__dict__, "memory_budget_bytes": gather_peak - 1})
    chosen, considered = choose_backend(s, topo, tight)
    assert chosen.name != "allgather" and "over the memory budget" in considered["allgather"]
    nothing = Profile(**{**NVLINK_PROFILE.__dict__, "memory_budget_bytes": 1})
    with pytest.raises(ValueError, match="no SP backend can run this attention"):
        choose_backend(s, topo, nothing)


def test_estimates_follow_the_profile():
    """Make all-to-all free and p2p/all-gather dear: Ulysses wins where it can run."""
    cheap = {c: LinkCost(1e-9, 1e15) if c == "all_to_all" else LinkCost(1.0, 1e3) for c in COLLECTIVES}
    profile = Profile(**{**CPU_GLOO_PROFILE.__dict__, "collectives": cheap})
    topo = Topology.for_planning(4)
    assert choose_backend(spec(8, 2, 4096, 4), topo, profile)[0].name == "ulysses"
    assert choose_backend(spec(6, 2, 4096, 4), topo, profile)[0].name != "ulysses"  # 6 heads over 4 ranks


def test_profile_json_round_trip(tmp_path):
    path = tmp_path / "profile.json"
    CPU_GLOO_PROFILE.save(str(path))
    assert usp.load_profile(str(path)) == CPU_GLOO_PROFILE
    broken = json.loads(path.read_text())
    del broken["collectives"]["p2p"]
    path.write_text(json.dumps(broken))
    with pytest.raises(ValueError, match="lacks collectives"):
        usp.load_profile(str(path))


def test_the_choice_is_cached_per_shape():
    topo = Topology.for_planning(1)
    attn = usp.SequenceParallelAttention(topo, backend="auto", layer_idx=3)
    for s in (8, 16, 8):
        q = torch.randn(1, s, 4, 8)
        attn(q, q, q)
    assert len(attn._chosen) == 2


def test_per_layer_backend_lists():
    class Layer:
        def __init__(self, i):
            self.layer_idx = i

    layers = [Layer(i) for i in range(3)]
    assert _backend_per_layer("ring", layers) == {0: "ring", 1: "ring", 2: "ring"}
    assert _backend_per_layer(["ulysses", "ring", "auto"], layers) == {0: "ulysses", 1: "ring", 2: "auto"}
    assert _backend_per_layer(lambda i: "ring" if i % 2 else "ulysses", layers)[1] == "ring"
    assert _backend_per_layer(["hybrid-u2", "auto", "hybrid"], layers)[0] == "hybrid-u2"
    assert usp.SequenceParallelAttention(Topology.for_planning(8), backend="hybrid-u2").backend == "hybrid-u2"
    for bad in ("hybrid-u0", "hybrid-2", "hybrid-u"):
        with pytest.raises(ValueError, match=f"unknown SP backend '{bad}'.*hybrid-u\\{{U\\}}"):
            usp.SequenceParallelAttention(Topology.for_planning(8), backend=bad)
    with pytest.raises(ValueError, match="one name per attention layer \\(3\\), got 2"):
        _backend_per_layer(["ulysses", "ring"], layers)


LLAMA3_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "head_dim": 128}


@pytest.mark.parametrize("ranks,ulysses", [(8, None), (64, 8)])
def test_plan_names_a_feasible_backend_for_every_layer(tmp_path, ranks, ulysses):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA3_8B))


    layers = layers_from_config(str(config))
    rows = plan_rows(layers, seq_len=128 * 1024, sp_size=ranks, ulysses_degree=ulysses, ranks_per_node=8, profile=NVLINK_PROFILE)
    assert sum(last - first + 1 for first, last, *_ in rows) == 32
    for _, _, shape, chosen, considered in rows:
        assert shape == LayerShape(32, 8, 128)
        assert isinstance(considered[chosen], Estimate)
    result = CliRunner().invoke(sp_bench, ["plan", "--model-config", str(config), "--seq", "128k", "--sp-size", str(ranks)]
                                + (["--ulysses-degree", str(ulysses)] if ulysses else []))
    assert result.exit_code == 0, result.output
    assert "0-31" in result.output and rows[0][3] in result.output


def test_plan_explains_bad_input():
    result = CliRunner().invoke(sp_bench, ["plan", "--heads", "8", "--seq", "1000", "--sp-size", "3"])
    assert result.exit_code != 0 and "multiple of 6" in result.output


def test_layers_of_one_pass_get_different_backends(ranks):
    for r in values(ranks(4), "policy/per-layer"):
        first, second = r[0], r[1]
        assert first["chosen"] == ["ulysses"] and second["chosen"] not in (["ulysses"], [])
        assert first["err"] < 1e-10 and second["err"] < 1e-10


def test_backend_overhead_adds_per_shard_byte():
    """A calibrated overhead adds seconds in proportion to the rank's shard bytes: linear in
    the sequence, so it decides short sequences and fades against the kernel at long ones."""
    topo = Topology.for_planning(4)
    short, long = spec(8, 2, 4096, 4), spec(8, 2, 65536, 4)
    plain = Profile(**{**CPU_GLOO_PROFILE.__dict__, "backend_overhead": {}, "backend_overhead_kv": None})
    chosen, before = choose_backend(short, topo, plain)
    per_byte = before[chosen.name].seconds / short.shard_bytes  # doubles its estimate at 4k
    slower = Profile(**{**plain.__dict__, "backend_overhead": {chosen.name: per_byte}})
    again, after = choose_backend(short, topo, slower)
    assert again.name != chosen.name
    assert after[chosen.name].seconds == pytest.approx(2 * before[chosen.name].seconds)
    assert short.shard_bytes == 4096 // 4 * 64 * 2 * (2 * 8 + 2 * 2)  # bf16
    _, long_before = choose_backend(long, topo, plain)
    _, long_after = choose_backend(long, topo, slower)
    added = long_after[chosen.name].seconds - long_before[chosen.name].seconds
    assert added == pytest.approx(16 * (after[chosen.name].seconds - before[chosen.name].seconds))
    assert added < 0.1 * long_before[chosen.name].seconds
    assert Profile.from_dict(json.loads(slower.to_json())).backend_overhead == {chosen.name: per_byte}
    with pytest.raises(ValueError, match="unknown fields.*backend_factors.*calibrate"):
        Profile.from_dict({**json.loads(slower.to_json()), "backend_factors": {}})


def test_backend_overhead_kv_counts_only_k_and_v_bytes():
    """Calibrated at an MHA and an MQA shape, the overhead is one figure per byte of q and
    output shards and one per byte of k and v shards; a profile measured at one shape (no
    ``backend_overhead_kv``) counts every shard byte at its one figure."""
    s = spec(16, 1, 4096, 2)
    one = Profile(**{**CPU_GLOO_PROFILE.__dict__, "backend_overhead": {"ring": 1e-9}, "backend_overhead_kv": None})
    assert one.overhead_seconds("ring", s) == pytest.approx(1e-9 * s.shard_bytes)
    split = Profile(**{**one.__dict__, "backend_overhead_kv": {"ring": 5e-9}})
    assert split.overhead_seconds("ring", s) == pytest.approx(1e-9 * 32 * s.head_bytes + 5e-9 * 2 * s.head_bytes)
    assert split.overhead_seconds("ulysses", s) == 0.0
    assert Profile.from_dict(json.loads(split.to_json())) == split


def test_default_profile_follows_the_rank_count():
    """On CPU auto estimates with the built-in profile measured at the largest rank count up to
    the SP size (2 or 4); on CUDA with the NVLink one whatever the size."""
    assert [default_profile("cpu", p) for p in (1, 2, 3, 4, 8)] == [CPU_GLOO_PROFILE] * 3 + [CPU_GLOO_PROFILE_P4] * 2
    assert default_profile("cuda", 4) is NVLINK_PROFILE
    s = spec(16, 1, 8192, 4, dtype=torch.float32)
    for p, builtin in ((2, CPU_GLOO_PROFILE), (4, CPU_GLOO_PROFILE_P4)):
        topo = Topology.for_planning(p)
        assert choose_backend(s, topo)[1] == choose_backend(s, topo, builtin)[1]


def test_a_profile_from_another_rank_count_warns():
    """Calibrated overheads are those of the rank count measured: auto says so when a profile
    from calibrate is used on another; built-in profiles and one of the same size are quiet."""
    import warnings

    s, topo = spec(8, 2, 4096, 4), Topology.for_planning(4)
    two = Profile(**{**CPU_GLOO_PROFILE.__dict__, "measured": {"world_size": 2}})
    with pytest.warns(UserWarning, match="measured on 2 ranks and is used on 4.*calibrate --nproc 4"):
        choose_backend(s, topo, two)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        choose_backend(s, topo, Profile(**{**two.__dict__, "measured": {"world_size": 4}}))
        choose_backend(s, topo)


def test_hybrid_overhead_is_looked_up_by_degree():
    """Calibration stores the hybrid's overhead under auto's name for it (``hybrid-u2``); a
    profile from an earlier version has one ``hybrid`` figure, which every degree then takes."""
    topo, s = Topology.for_planning(8), spec(16, 16, 8192, 8)
    plain = Profile(**{**CPU_GLOO_PROFILE_P4.__dict__, "backend_overhead": {}, "backend_overhead_kv": None})
    base = choose_backend(s, topo, plain)[1]
    for overhead, u2, u4 in (({"hybrid": 1e-9}, 1e-9, 1e-9), ({"hybrid-u2": 2e-9, "hybrid": 1e-9}, 2e-9, 1e-9), ({"hybrid-u4": 3e-9}, 0, 3e-9)):
        _, considered = choose_backend(s, topo, Profile(**{**plain.__dict__, "backend_overhead": overhead}))
        for name, per_byte in (("hybrid-u2", u2), ("hybrid-u4", u4)):
            assert considered[name].seconds - base[name].seconds == pytest.approx(per_byte * s.shard_bytes)


@pytest.mark.parametrize("a,c", [(2e-9, 5e-10), (3e-9, 0.0), (0.0, 4e-9)])
def test_overhead_fit_recovers_both_figures(a, c):
    """Calibration's two equations (MHA and MQA shards) give back the per-byte figures that
    produced them; a negative solution (noise) becomes the better one-term fit, never < 0."""
    rows = [(q, kv, a * q + c * kv) for q, kv in ((16, 16), (32, 2))]
    assert _fit(rows) == pytest.approx((a, c))
    got = _fit([(16, 16, 10.0), (32, 2, 1.0)])  # exact: a < 0
    assert min(got) == 0.0 and max(got) > 0


def test_calibration_pairs_backends_within_a_round():
    """A backend's excess over the leanest is the median of their differences within a round,
    where the two ran one after the other: the machine's drift between rounds, common to
    both, cancels. Simulated: 9 rounds, drift sd 0.3 s, per-run noise sd 0.02 s, a true
    excess of 0.5 s; over 200 calibrations the paired figure errs by about half what the
    difference of the two medians does (which, drift deciding the order, is one round's)."""
    import random
    import statistics

    rng = random.Random(0)
    paired_err, medians_err = [], []
    for _ in range(200):
        drift = [rng.gauss(0, 0.3) for _ in range(9)]
        runs = {name: [base + d + rng.gauss(0, 0.02) for d in drift] for name, base in (("lean", 1.0), ("dear", 1.5))}
        times = {name: {"runs_s": r, "measured_s": statistics.median(r), "estimated_s": 0.25} for name, r in runs.items()}
        got = _excess_over(times, "lean")
        assert got["lean"] == 0.0
        paired_err.append(got["dear"] - 0.5)
        medians_err.append(times["dear"]["measured_s"] - times["lean"]["measured_s"] - 0.5)
    rms = lambda errs: statistics.fmean(e * e for e in errs) ** 0.5  # noqa: E731
    assert rms(paired_err) < 0.6 * rms(medians_err)  # 0.012 against 0.025 s


def test_auto_at_scale_respects_the_budget_and_the_kernel(monkeypatch):
    """S_local=16k on 8 ranks, H32/KV8, D128, bf16 (issue 14's shapes) on H100-class GPUs: the
    estimates include the kernel's working memory, the budget defaults to what the device
    reports free, and no backend on the math kernel's O(S^2) path fits it."""
    import dataclasses

    free = 75 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * 2**30))
    topo = dataclasses.replace(Topology.for_planning(8, ulysses_degree=2, ranks_per_node=8), device=torch.device("cuda", 0))
    for kernel in ("flash_attn", "torch"):
        s = dataclasses.replace(spec(32, 8, 16384 * 8, 8, d=128), kernel=kernel)
        chosen, considered = choose_backend(s, topo, NVLINK_PROFILE)
        assert considered[chosen.name].peak_bytes <= free
        assert all(e.peak_bytes < 2**30 * 4 for e in considered.values() if isinstance(e, Estimate)), considered
    s = dataclasses.replace(spec(32, 8, 16384 * 8, 8, d=128), kernel="math")
    try:  # the suite registers all-gathers of one KV head at a time, whose S_q x S_k blocks may fit
        chosen, considered = choose_backend(s, topo, NVLINK_PROFILE)
        assert considered[chosen.name].peak_bytes <= free
    except ValueError as e:  # "no SP backend can run this attention: NAME: why; NAME: why; ..."
        considered = {part.split(": ", 1)[0]: part for part in str(e).split("attention: ", 1)[1].split("; ")}
    for name in ("ulysses", "allgather", "ring", "hybrid-u2", "hybrid-u4"):
        assert "over the memory budget of 76800 MiB" in str(considered[name]), considered[name]
    assert usp.kernels.resolve_kernel("auto", torch.bfloat16, topo.device, 128) != "math"


def test_auto_weighs_the_hybrid_at_every_ulysses_degree():
    """6 q heads on 8 ranks: Ulysses (U = 8) and hybrid-u4 cannot split them, hybrid-u2
    (U = 2 x R = 4) can; the plain "hybrid" (the topology's degree) is not a separate candidate."""
    topo = Topology.for_planning(8, ranks_per_node=8)
    for hkv in (6, 2):
        _, considered = choose_backend(spec(6, hkv, 8192, 8, d=128), topo, NVLINK_PROFILE)
        assert [n for n in considered if n.startswith("hybrid")] == ["hybrid-u2", "hybrid-u4"]
        assert isinstance(considered["hybrid-u2"], Estimate)
        assert considered["hybrid-u4"].startswith("hybrid-u4: q heads (6) must divide by the all-to-all degree (4); hybrid-u2 fits")
        assert considered["ulysses"].startswith("ulysses: q heads (6) must divide by the all-to-all degree (8)")
    assert get_backend("hybrid-u2") is get_backend("hybrid-u2") and get_backend("hybrid-u2").groups(topo) == HybridGroups(None, 0, 2, None, 0, 4)
    assert get_backend("hybrid").groups(topo).ulysses_degree == 8
    assert get_backend("hybrid-u3").check(spec(6, 6, 8192, 8), topo).startswith("hybrid-u3: ulysses_degree must be a positive integer dividing sp_size (8), got 3; valid values: [1, 2, 4, 8]")
    assert "that split is the ring backend" in get_backend("hybrid-u1").check(spec(6, 6, 8192, 8), topo)
    with pytest.raises(ValueError, match="that split is the ulysses backend"):
        Topology.for_planning(8, ulysses_degree=2).hybrid_groups(8)
    two_nodes = Topology.for_planning(16, ranks_per_node=8)
    assert [two_nodes.spans_nodes(g, u) for g in ("ulysses", "ring") for u in (2, 16)] == [False, True, True, False]


@pytest.mark.parametrize("ranks,seq", [(8, 8192), (16, 32768)])
def test_auto_picks_hybrid_u2_where_it_beats_ring_and_allgather(ranks, seq):
    """6 heads (Llama-style, D128, bf16) under the built-in NVLink profile, 8 GPUs per node:
    one node at 8k (hybrid-u2 ~0.42 ms, all-gather ~0.52, ring ~0.71), two nodes at 32k where
    the Ulysses pairs stay inside a node and the ring crosses (~4.8 ms against ~9.6 for both)."""
    chosen, considered = choose_backend(spec(6, 6, seq, ranks, d=128), Topology.for_planning(ranks, ranks_per_node=8), NVLINK_PROFILE)
    assert chosen.name == "hybrid-u2"
    assert considered["hybrid-u2"].seconds < min(considered["ring"].seconds, considered["allgather"].seconds)


def test_auto_picks_hybrid_u2_on_four_ranks(ranks):
    """2 heads on a topology of Ulysses degree 4: auto takes hybrid-u2 (the cheapest under a
    profile that makes the ring and the all-gather dear), which runs on groups the default
    topology built, and matches the reference."""
    for r in values(ranks(4), "parity/auto/zigzag-causal-2-heads-topo-u4"):
        feasible = {n: t for n, t in r["considered"].items() if isinstance(t, float)}
        assert r["chosen"] == ["hybrid-u2"] == [min(feasible, key=feasible.get)]
        assert r["considered"]["ulysses"].startswith("ulysses: q heads (2)")
        assert max(r[g] for g in ("out", "dq", "dk", "dv")) < 1e-10


@pytest.mark.parametrize("ranks", [8, 64])
def test_gemma3_like_stack_gets_halo_on_sliding_layers(ranks):
    """5 sliding layers (W = 1024) per full layer, 8 q / 4 kv heads, D128, 128k tokens, NVLink
    (8 per node): halo (O(W) bytes) for every sliding layer, a full-attention backend for the others."""
    layers = ([LayerShape(8, 4, 128, 1024)] * 5 + [LayerShape(8, 4, 128)]) * 2
    rows = plan_rows(layers, seq_len=128 * 1024, sp_size=ranks, ranks_per_node=8, profile=NVLINK_PROFILE)
    assert [(first, last) for first, last, *_ in rows] == [(0, 4), (5, 5), (6, 10), (11, 11)]
    for first, last, shape, chosen, considered in rows:
        if shape.window:
            assert chosen == "halo"
            assert considered["halo"].comm_bytes < min(e.comm_bytes for e in considered.values() if isinstance(e, Estimate) and e is not considered["halo"])
        else:
            assert chosen != "halo" and considered["halo"].startswith("halo: only for sliding-window layers")


def test_plan_shows_the_ulysses_degree():
    result = CliRunner().invoke(sp_bench, ["plan", "--heads", "6", "--seq", "8k", "--sp-size", "8", "--layers", "4"])
    assert result.exit_code == 0, result.output
    assert "hybrid U=2 x R=4" in result.output and "0-3" in result.output and "hybrid-u4" in result.output


@pytest.mark.parametrize("config,windows", [
    ({"model_type": "gemma3_text", "num_hidden_layers": 6, "sliding_window": 512,
      "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}, [512] * 5 + [None]),
    ({"model_type": "gemma3_text", "num_hidden_layers": 7, "sliding_window": 512, "sliding_window_pattern": 6}, [512] * 5 + [None, 512]),
    ({"model_type": "gemma2", "num_hidden_layers": 4, "sliding_window": 4096}, [4096, None, 4096, None]),
    ({"model_type": "qwen2", "num_hidden_layers": 4, "sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 2}, [None] * 4),
    ({"model_type": "qwen2", "num_hidden_layers": 4, "sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 2}, [None, None, 4096, 4096]),
    ({"model_type": "mistral", "num_hidden_layers": 3, "sliding_window": 4096}, [4096] * 3),
    ({"model_type": "mistral", "num_hidden_layers": 3, "sliding_window": None}, [None] * 3),
])
def test_plan_reads_sliding_windows_per_layer(tmp_path, config, windows):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512, **config}))
    layers = layers_from_config(str(path))
    assert [layer.window for layer in layers] == windows
    rows = plan_rows(layers, seq_len=8192, sp_size=4, profile=NVLINK_PROFILE)
    expected, first = [], 0  # consecutive layers with one window form one row
    for window, run in itertools.groupby(windows):
        last = first + len(list(run)) - 1
        expected.append((first, last, window))
        first = last + 1
    assert [(first, last, shape.window) for first, last, shape, *_ in rows] == expected


def test_plan_gives_a_hybrids_mixer_layers_a_mixer_strategy(tmp_path):
    """A hybrid's layer_types: its mixer layers get a mixer strategy, not an attention backend, with
    each strategy's estimate (compute share, bytes); MoE/MLP entries mix nothing. A model transformers
    cannot build gets the allgather fallback ((P-1) x the local hidden states each way)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "my_hybrid", "num_hidden_layers": 5, "num_attention_heads": 16, "num_key_value_heads": 2,
                                "head_dim": 256, "hidden_size": 2048,
                                "layer_types": ["linear_attention", "linear_attention", "full_attention", "moe", "linear_attention"]}))
    layers = layers_from_config(str(path))
    assert [layer.mixer for layer in layers] == ["linear_attention", "linear_attention", None, None, "linear_attention"]
    rows = plan_rows(layers, seq_len=128 * 1024, sp_size=8, ranks_per_node=8, profile=NVLINK_PROFILE)
    assert [(first, last, chosen) for first, last, _, chosen, _ in rows][::2] == [(0, 1, "allgather"), (4, 4, "allgather")]
    local = 128 * 1024 // 8 * 2048 * 2  # bf16 hidden states of one rank
    assert rows[0][4]["allgather"] == MixerEstimate(1.0, 7 * local, 7 * local)
    assert rows[0][4]["ulysses"].startswith("needs the mixer's class (linear_attention): install transformers"), rows[0][4]
    assert rows[1][:2] == [2, 3] and isinstance(rows[1][4]["ring"], Estimate)  # attention (and the MoE layer): the backends
    result = CliRunner().invoke(sp_bench, ["plan", "--model-config", str(path), "--seq", "8k", "--sp-size", "4"])
    assert result.exit_code == 0 and "linear_attention" in result.output and "mixer" in result.output, result.output


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="builds the layers from the config with transformers")
def test_plan_gives_deepseek_sparse_attention_the_indexed_strategy(tmp_path):
    """DeepSeek-V3.2's default config (61 layers of indexed attention) at 128k tokens on 8 ranks: the indexed strategy on
    every layer (it used to show allgather, and "install transformers" for the others), its bytes a layer and rank: 7 x
    16k tokens x (512 + 64 + 128) values forward, the latent's 576 backward, bf16."""
    import transformers

    path = tmp_path / "deepseek_v32.json"
    transformers.DeepseekV32Config().to_json_file(path)
    rows = plan_rows(layers_from_config(str(path)), seq_len=128 * 1024, sp_size=8, profile=NVLINK_PROFILE)
    assert [(first, last, chosen) for first, last, _, chosen, _ in rows] == [(0, 60, "indexed")], rows
    local = 128 * 1024 // 8 * 2
    assert rows[0][4] == {"indexed": MixerEstimate(1 / 8, 7 * local * (576 + 128), 7 * local * 576)}, rows[0][4]


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="builds the layers from the config with transformers")
def test_plan_gives_deepseek_v4_the_compressed_strategy(tmp_path):
    """DeepSeek-V4's default config (43 layers, heavily compressed and compressed sparse) at 128k tokens on 8 ranks: the
    compressed strategy on every layer; a layer and rank's bytes, bf16: the 127 rows before each of two zigzag chunks
    (hidden 4096) both ways, and 7 x the rank's entries (16k / 4 of 512 + 128 values forward, 512 backward; 16k / 128 of 512)."""
    import transformers

    path = tmp_path / "deepseek_v4.json"
    transformers.DeepseekV4Config().to_json_file(path)
    rows = plan_rows(layers_from_config(str(path)), seq_len=128 * 1024, sp_size=8, profile=NVLINK_PROFILE)
    assert {chosen for _, _, _, chosen, _ in rows} == {"compressed"} and (rows[0][0], rows[-1][1]) == (0, 42), rows
    halo, entries = 2 * 127 * 4096 * 2, 7 * 128 * 1024 // 8 * 2
    sparse = next(row for row in rows if hasattr(row[2].module.compressor, "indexer"))
    assert (sparse[4]["compressed"].comm_bytes, sparse[4]["compressed"].bwd_comm_bytes) == (halo + entries // 4 * 640, halo + entries // 4 * 512)
    assert (rows[0][4]["compressed"].comm_bytes, rows[0][4]["compressed"].bwd_comm_bytes) == (halo + entries // 128 * 512,) * 2


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="builds the mixer from the config with transformers")
def test_plan_estimates_each_mixer_strategy_from_the_models_own_layers(tmp_path):
    """Qwen3-Next (Gated DeltaNet: 16 key, 32 value heads of 128) and LFM2 (short convolution, kernel 3)
    at 128k tokens on 8 ranks: auto takes state (at 8k, ulysses) and halo, by estimated time; bytes by
    hand: ulysses, q, k, v, the gates and the output, 7/8 of each; state, each fragment's summary and
    convolution tail to 7 ranks; halo, the 2 tokens before each chunk held elsewhere."""
    tokens, p, bf16 = 128 * 1024, 8, 2
    path = tmp_path / "qwen3_next.json"
    path.write_text(json.dumps({"model_type": "qwen3_next", "num_hidden_layers": 2, "hidden_size": 2048, "num_attention_heads": 16,
                                "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                                "linear_key_head_dim": 128, "linear_value_head_dim": 128, "num_experts": 4,
                                "layer_types": ["linear_attention", "full_attention"]}))
    (first, last, _, chosen, considered), _ = plan_rows(layers_from_config(str(path)), seq_len=tokens, sp_size=p, profile=NVLINK_PROFILE)
    per_token = (2 * 16 * 128 + 32 * 128 + 2 * 32) * bf16 + 32 * 128 * bf16
    moved = tokens // p * per_token * (p - 1) // p
    assert considered["ulysses"] == MixerEstimate(1 / p, moved, moved), considered
    summary, halo = 32 * 128 * (128 + 128) * 4, 3 * (2 * 16 * 128 + 32 * 128) * bf16  # [dk, dv + dk] per value head in fp32; 3 conv tokens
    assert (considered["state"].comm_bytes, considered["state"].bwd_comm_bytes) == ((p - 1) * 2 * (summary + halo),) * 2, considered
    assert considered["allgather"].compute == 1.0 and considered["halo"].startswith("halo: no reach registered"), considered
    seconds = {n: e.seconds for n, e in considered.items() if isinstance(e, MixerEstimate)}
    assert chosen == "state" == min(seconds, key=seconds.get), seconds  # at 128k: the summaries' 57 MiB beat the all-to-all's 338 MiB
    (_, _, _, chosen, considered), _ = plan_rows(layers_from_config(str(path)), seq_len=8192, sp_size=p, profile=NVLINK_PROFILE)
    assert chosen == "ulysses", considered  # at 8k: the all-to-all moves less than the summaries, at less compute
    path = tmp_path / "lfm2.json"
    path.write_text(json.dumps({"model_type": "lfm2", "num_hidden_layers": 2, "hidden_size": 1024, "num_attention_heads": 16,
                                "num_key_value_heads": 8, "conv_L_cache": 3, "layer_types": ["conv", "full_attention"]}))
    (_, _, _, chosen, considered), _ = plan_rows(layers_from_config(str(path)), seq_len=tokens, sp_size=p, profile=NVLINK_PROFILE)
    chunk = tokens // (2 * p)  # zigzag: two chunks a rank, each but chunk 0 after another rank's
    assert chosen == "halo" and considered["halo"] == MixerEstimate((2 * chunk + 2 * 2) / tokens, 2 * 2 * 1024 * bf16, 2 * 2 * 1024 * bf16)
    assert considered["ulysses"].startswith("ulysses: no adapter for Lfm2ShortConv"), considered


def _one_long_document(seq: int) -> tuple[int, ...]:
    """One document of 3/4 of the row, then 512-token ones: zigzag's slowest rank does 1.73-1.75x the mean."""
    return (0, 3 * seq // 4, *range(3 * seq // 4 + 512, seq + 1, 512))


@pytest.mark.parametrize("seq", [8192, 16384])
def test_auto_weighs_the_slowest_ranks_work_on_packed_rows(seq):
    """On a packed row under zigzag, the backends that split the work by chunks wait on their
    slowest rank: their compute is scaled by its work over the mean, and auto stops picking the
    ring where it would idle (8 q / 2 KV heads, P=2, CPU profile: ring before, within 1%; ulysses
    now, 1.7x ahead). Under balanced the ring's imbalance is 1.00 and it is picked again."""
    from ulysses_sp.layout import work_imbalance

    cu = _one_long_document(seq)
    picks = {}
    for lay in ("zigzag", "balanced"):
        (_, _, _, chosen, considered), = plan_rows([LayerShape(8, 2, 64)], seq_len=seq, sp_size=2, layout=lay, profile=CPU_GLOO_PROFILE,
                                                    dtype=torch.float32, cu_seqlens=cu)
        standard = {n: e.seconds for n, e in considered.items() if n in ("ulysses", "allgather", "ring", "hybrid")}
        assert chosen not in standard or chosen == min(standard, key=standard.get)
        picks[lay] = min(standard, key=standard.get)  # among the built-in backends (other tests register variants)
        assert considered["ulysses"].work_imbalance == 1.0
        for name in ("ring", "allgather"):
            assert considered[name].work_imbalance == pytest.approx(work_imbalance(lay, seq, 2, cu), abs=1e-12)
    assert work_imbalance("zigzag", seq, 2, cu) > 1.7
    assert picks == {"zigzag": "ulysses", "balanced": "ring"}, picks


def test_work_imbalance_scales_only_the_compute():
    """The ring's estimate on the packed zigzag row: its unpacked form's transfers, plus the packed
    row's compute times the imbalance (the CPU profile overlaps nothing: a plain sum)."""
    from ulysses_sp.layout import work_imbalance

    seq, cu = 8192, _one_long_document(8192)
    topo = Topology.for_planning(2, profile=CPU_GLOO_PROFILE)

    def spec(docs):
        return AttnSpec(batch=1, seq_len=seq, local_seq_len=seq // 2, q_heads=8, kv_heads=8, head_dim=64, dtype=torch.float32,
                        causal=True, softmax_scale=0.125, layout="zigzag", cu_seqlens=docs)

    ring = get_backend("ring")
    packed, even = ring.estimate(spec(cu), topo, CPU_GLOO_PROFILE), ring.estimate(spec(None), topo, CPU_GLOO_PROFILE)
    compute = {d: CPU_GLOO_PROFILE.attention_fwd_bwd_seconds(spec(d), 2) for d in (cu, None)}
    assert CPU_GLOO_PROFILE.overlap == 0.0
    assert packed.seconds - compute[cu] * packed.work_imbalance == pytest.approx(even.seconds - compute[None], rel=1e-12)
    assert even.work_imbalance == 1.0 and packed.work_imbalance == pytest.approx(work_imbalance("zigzag", seq, 2, cu), abs=1e-12)
    assert packed.work_imbalance > 1.7


def test_plan_shows_each_layouts_imbalance_for_packed_rows():
    result = CliRunner().invoke(sp_bench, ["plan", "--heads", "8", "--kv-heads", "2", "--head-dim", "64", "--seq", "16k", "--sp-size", "2",
                                           "--docs", "12k,512x8"])
    assert result.exit_code == 0, result.output
    assert "packed row: 9 documents, 512 to 12288 tokens (median 512)" in result.output
    assert "contiguous 1.123, zigzag 1.753, balanced 1.000" in result.output
    assert "x1.75 work" in " ".join(result.output.split())  # the ring's and the all-gather's estimates under zigzag
    bad = CliRunner().invoke(sp_bench, ["plan", "--heads", "8", "--seq", "16k", "--sp-size", "2", "--docs", "12k,abc"])
    assert bad.exit_code != 0 and "a pattern is lengths with optional counts" in bad.output


def test_docs_specs():
    from ulysses_sp.cli.docs import parse_docs

    assert parse_docs("12k,512x8", 16384) == (0, 12288, *range(12800, 16385, 512))
    assert parse_docs("3", 8) == (0, 3, 6, 8)  # the pattern repeats, the last document is cut at the row's end
    drawn = parse_docs("lognormal:2k:1.5", 131072, seed=3)
    assert drawn == parse_docs("lognormal:2k:1.5", 131072, seed=3) != parse_docs("lognormal:2k:1.5", 131072, seed=4)
    assert drawn[0] == 0 and drawn[-1] == 131072 and all(b > a for a, b in zip(drawn, drawn[1:]))
    for bad, message in (("lognormal:2k", "lognormal:MEDIAN:SIGMA"), ("lognormal:2k:-1", "sigma must be >= 0"), ("0", "must be positive")):
        with pytest.raises(ValueError, match=message):
            parse_docs(bad, 64)


def test_plan_shares_an_image_text_models_vision_tower(tmp_path):
    """5 images of 64 x 64 pixels (Qwen2.5-VL's 4-pixel patches merged 2 x 2: 256 patches, 64 tokens
    each) over 4 ranks: one rank encodes two, the others one; a text model's config is refused."""
    transformers = pytest.importorskip("transformers")
    from .vlm_cases import _qwen2_5_vl

    config = tmp_path / "config.json"
    config.write_text(json.dumps(_qwen2_5_vl().config.to_dict()))
    result = CliRunner().invoke(sp_bench, ["plan", "--model-config", str(config), "--seq", "4k", "--sp-size", "4", "--images", "5",
                                           "--image-size", "64x64"])
    assert result.exit_code == 0, result.output
    assert "5 images of 64x64 pixels, 256 patches and 64 tokens each (320 of the 4096 tokens)" in result.output, result.output
    assert "the busiest rank 2 images, 512 patches" in result.output and "(40.0% of one process's" in result.output, result.output
    assert "over the mean 1.60" in result.output, result.output
    text = tmp_path / "text.json"
    text.write_text(json.dumps(transformers.LlamaConfig(num_hidden_layers=2).to_dict()))
    result = CliRunner().invoke(sp_bench, ["plan", "--model-config", str(text), "--seq", "4k", "--sp-size", "4", "--images", "5"])
    assert result.exit_code != 0 and "this config's model_type is 'llama'" in result.output, result.output
