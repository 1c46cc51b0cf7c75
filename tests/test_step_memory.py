"""The memory model of a training step (``ulysses_sp.step_memory``, ``sp-bench plan --max-seq-len``):
its prediction against the peak measured on real tensors, its extrapolation over depth, its search."""

import json
import os

import click
import pytest

from .conftest import values, warm_python
from .step_memory_cases import SEQ, WORLDS, switch_sets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def predicted(tmp_path_factory):
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("step_memory") / "predicted.json"
    log = out.with_suffix(".log")
    proc = warm_python([os.path.join(ROOT, "tests", "step_memory_cases.py"), str(out)], env=dict(os.environ), cwd=ROOT, log=str(log))
    proc.join(600)
    assert proc.exitcode == 0, log.read_text()[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("world", WORLDS)
def test_prediction_within_10_percent_of_measured_peak(ranks, predicted, world):
    """Every switch set, every rank: the predicted peak (engine states by formula, the step on the
    meta device) within 10% of the peak PeakMemory counts over a real second step on CPU; offloaded
    checkpoints: the bytes the store took, exactly (``step_memory_cases.measured``: how they leave)."""
    for rank, got in enumerate(values(ranks(world), "step_memory/measured")):
        assert sorted(got) == sorted(switch_sets(world))
        for name, m in got.items():
            p = predicted[f"{world}/{name}"]
            host_per_rank = p["host_checkpoints"] // world
            assert m["offloaded_bytes"] == host_per_rank, (name, m, p)
            assert abs(m["peak"] - p["peak"]) <= 0.10 * m["peak"], (world, rank, name, m["peak"], p)


def test_zero3_prediction_within_10_percent_of_measured_peak(ranks, predicted):
    """DeepSpeed ZeRO-3 in bf16 with AdamW, the optimizer on the device or offloaded, at P=2: the
    engine's states by formula (at the buckets the run was given) and the step on the meta device
    against PeakMemory over a real second step on CPU, where the offloaded states (host memory
    on a GPU machine) are counted too."""
    pytest.importorskip("deepspeed")
    from .step_memory_cases import DS_RUNS

    for rank, got in enumerate(values(ranks(2), "step_memory/deepspeed")):
        for name in DS_RUNS:
            p = predicted[f"2/{name}"]
            expected = p["peak"] + p["host_optimizer"] // 2
            assert abs(got[name]["peak"] - expected) <= 0.10 * got[name]["peak"], (rank, name, got[name]["peak"], expected, p)
        assert predicted["2/zero3+offload"]["optimizer"] == 0 < predicted["2/zero3+offload"]["host_optimizer"]


def test_one_and_two_layers_extrapolate_to_the_whole_depth(predicted):
    for keep in (False, True):  # gradients sharded (dropped as they come) and kept whole
        got = predicted[f"2/depth/{keep}"]
        assert got["whole"] == got["extrapolated"], got


@pytest.mark.parametrize("mixer", ["ulysses", "state"])
def test_a_hybrids_layer_kinds_extrapolate_to_the_whole_depth(predicted, mixer):
    """Qwen3.5-shaped, 4 Gated DeltaNet and 2 attention layers, from 2 and 4 layers' runs: offloaded
    checkpoints, exactly; checkpointed layers, the peak within 10% above (the two kinds' working
    memories differ, and the larger extra is taken), the rest exactly."""
    exact = predicted[f"2/hybrid/{mixer}/offload"]
    assert exact["whole"] == exact["extrapolated"], exact
    layers = predicted[f"2/hybrid/{mixer}/layers"]
    whole, got = layers["whole"], layers["extrapolated"]
    assert whole["peak"] <= got["peak"] <= 1.10 * whole["peak"] and {k: v for k, v in whole.items() if k != "peak"} == \
        {k: v for k, v in got.items() if k != "peak"}, layers


def test_a_gated_deltanets_scan_on_the_meta_device_holds_its_kernels_memory():
    """The stand-in for the chunked scan (no loop over chunks): the output, and the float32 chunk
    states [B, H, S/64, K, V] while it runs, forward and backward; gradients for every input."""
    import torch

    from ulysses_sp.meta_scans import _gated_delta_rule
    from ulysses_sp.testing.memory import PeakMemory

    b, s, hk, hv, k, v = 1, 4096, 2, 4, 16, 32
    q_bshd, k_bshd = (torch.empty(b, s, hk, k, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    v_bshd = torch.empty(b, s, hv, v, device="meta", dtype=torch.bfloat16, requires_grad=True)
    g, beta = (torch.empty(b, s, hv, device="meta", requires_grad=True) for _ in range(2))
    states = b * hv * (s // 64) * k * v * 4
    with PeakMemory() as fwd:
        out, final = _gated_delta_rule(q_bshd, k_bshd, v_bshd, g, beta, output_final_state=True)
    assert out.shape == v_bshd.shape and out.dtype == torch.bfloat16 and final.shape == (b, hv, k, v)
    assert fwd.peak == states + out.numel() * 2 + final.numel() * 4, fwd.peak
    with PeakMemory() as bwd:
        out.sum().backward()
    assert all(t.grad is not None and t.grad.shape == t.shape for t in (q_bshd, k_bshd, v_bshd, g, beta))
    assert bwd.peak >= states + sum(t.numel() * t.element_size() for t in (q_bshd, k_bshd, v_bshd, g, beta)), bwd.peak


def test_the_meta_step_replaces_each_delta_rules_scan_and_puts_it_back():
    """Gated DeltaNet's and Kimi Delta Attention's torch scans (what their adapters call), inside ``meta_scans`` only."""
    import importlib

    from ulysses_sp.meta_scans import _gated_delta_rule, meta_scans

    pytest.importorskip("transformers")
    modules = {name: importlib.import_module(f"transformers.models.{path}") for name, path in (
        ("torch_chunk_gated_delta_rule", "qwen3_5.modeling_qwen3_5"), ("chunk_kimi_delta_attention", "kimi_linear.modeling_kimi_linear"))}
    before = {name: getattr(m, name) for name, m in modules.items()}
    with meta_scans():
        assert all(getattr(m, name) is _gated_delta_rule for name, m in modules.items())
    assert {name: getattr(m, name) for name, m in modules.items()} == before


def test_switches_order_the_peak(predicted):
    """Each switch lowers the step's peak at this shape: the loss's logits, the MLP's and norms' intermediates, the layers' activations."""
    peaks = [predicted[f"2/{name}"]["peak"] for name in ("plain", "loss", "loss+mlp+norms", "all+layers")]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4, peaks
    for world in WORLDS:
        assert predicted[f"{world}/all+offload"]["host_checkpoints"] == world * 4 * (SEQ // world) * 128 * 4  # 4 layers' fp32 inputs per rank


def test_max_seq_len_cli_answers_at_the_limit(predicted):
    cli = predicted["cli"]
    assert cli["exit_code"] == 0, cli["output"]
    answer = cli["answer"]
    cap = 24 * 2**20
    assert answer["max_seq_len"] > 0 and answer["breakdown"]["peak"] <= cap < cli["beyond_peak"], cli
    assert "longest sequence:" in cli["output"] and "limited by GPU memory" in cli["output"], cli["output"]


@pytest.mark.quick
def test_sizes_and_bad_options():
    from click.testing import CliRunner

    from ulysses_sp.cli.main import main
    from ulysses_sp.cli.memory import parse_bytes

    assert parse_bytes("80GB") == 80 * 10**9 and parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("1.5TB") == 15 * 10**11
    assert parse_bytes("none") is None
    with pytest.raises(click.BadParameter, match="not a size"):
        parse_bytes("80 gigs")
    result = CliRunner().invoke(main, ["plan", "--max-seq-len"])
    assert result.exit_code == 2 and "--max-seq-len needs --model-config" in result.output
    result = CliRunner().invoke(main, ["plan", "--max-seq-len", "--model-config", __file__, "--gpu-memory", "none"])
    assert result.exit_code == 2 and "--gpu-memory needs a size" in result.output
    result = CliRunner().invoke(main, ["plan", "--heads", "8"])
    assert result.exit_code == 2 and "give --sp-size" in result.output


@pytest.mark.quick
def test_bad_world_and_engine():
    from ulysses_sp.step_memory import Engine, World

    with pytest.raises(ValueError, match="sp size 3 must divide the 8 ranks"):
        World(8, 1, 3)
    with pytest.raises(ValueError, match="engine must be one of"):
        Engine("zero4")
    with pytest.raises(ValueError, match="optimizer offload is DeepSpeed's"):
        Engine("fsdp2", offload_optimizer=True)


def test_host_tensors_made_under_the_meta_memory_mode_stay_on_the_host():
    """The mode makes a repeated op's output anew without running it, on the meta device: not a host tensor's (a layout's
    positions, made twice by DeepSeek Sparse Attention's layers, came back as meta and could not be joined to the first)."""
    import torch

    from ulysses_sp.step_memory import MetaPeakMemory

    with MetaPeakMemory():
        first, second = torch.arange(8), torch.arange(8)
        joined = torch.cat([first, second])
        meta = torch.empty(4, device="meta") + 1
        again = torch.empty(4, device="meta") + 1
    assert first.device.type == second.device.type == joined.device.type == "cpu" and joined.tolist() == list(range(8)) * 2
    assert meta.device.type == again.device.type == "meta"


def test_an_eager_only_model_is_built_for_the_step():
    """DeepSeek-V4 supports no SDPA: the step's model is built with eager attention there (it stopped with transformers'
    "does not support an attention implementation through torch.nn.functional.scaled_dot_product_attention")."""
    transformers = pytest.importorskip("transformers")
    import torch

    from ulysses_sp.step_memory import _build

    model = _build(transformers.DeepseekV4Config(), 1, torch.bfloat16, 4096)
    assert model.config._attn_implementation == "eager" and next(model.parameters()).device.type == "meta"
    assert _build(transformers.LlamaConfig(), 1, torch.bfloat16, 4096).config._attn_implementation == "sdpa"
