"""Tiled MLP and activation checkpointing (plain and offloaded) are exact: fp32, relative 1e-5
on the loss and every parameter gradient, tiling/checkpointing on against off (observed: loss
identical, gradients up to 4.1e-7 on the HF cases, 2.8e-7 under DeepSpeed, updated parameters 1e-7).

One process: the tiled MLP against the MLP (tiles dividing S, not dividing it, larger than S,
batch 2, frozen input), the offload store's counters and bad options. Two ranks: a tiny HF
Llama with SP (every backend) with tiled_mlp + checkpoint in {layers, offload}, packed once,
and the same tile count on both ranks. DeepSpeed ZeRO-2 and ZeRO-3 (SP=2, and SP=2 x DP=2):
one step's loss, gradients and updated parameters equal the untiled, unchecked run.
"""

import copy

import pytest
import torch

from ulysses_sp import tiling

TOL = 1e-5


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


class _MLP(torch.nn.Module):
    """LlamaMLP's shape: down(act(gate(x)) * up(x))."""

    def __init__(self, h=16, i=40):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (torch.nn.Linear(h, i), torch.nn.Linear(h, i), torch.nn.Linear(i, h))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("batch,seq,tile", [(1, 24, 6), (1, 24, 5), (1, 24, 100), (2, 13, 4), (3, 7, 1)])
@pytest.mark.parametrize("input_grad", [True, False])
@pytest.mark.quick
def test_tiled_mlp_equals_mlp(batch, seq, tile, input_grad):
    torch.manual_seed(0)
    mlp = _MLP()
    tiled_mlp = copy.deepcopy(mlp)
    x = torch.randn(batch, seq, 16, requires_grad=input_grad)
    g = torch.randn(batch, seq, 16)
    ref = mlp(x)
    ref.backward(g)
    ref_dx = x.grad.clone() if input_grad else None
    x.grad = None
    n = tiling.tile_count(batch * seq, tile)
    tiled = tiling.TiledMLP(tiled_mlp, tile, None, False)
    out = tiled(x)
    out.backward(g)
    assert list(tiled.counts) == [n]
    assert n == -(-batch * seq // tile)
    assert tiled_mlp.calls == 2 * n  # n tiles forward, n recomputed in the backward
    assert _rel(out, ref) < TOL
    if input_grad:
        assert _rel(x.grad, ref_dx) < TOL
    for p, p_ref in zip(tiled_mlp.parameters(), mlp.parameters()):
        assert _rel(p.grad, p_ref.grad) < TOL
        assert p.ds_grad_is_ready is True


def test_more_tiles_than_tokens_calls_the_module_n_times():
    """A rank with fewer tokens than the agreed count runs empty tiles: the call count never depends on data."""
    mlp = _MLP()
    x = torch.randn(1, 3, 16, requires_grad=True)
    tiling.TiledMLPFunction.apply(x, mlp, 5, list(mlp.parameters())).sum().backward()
    assert mlp.calls == 10


def test_offload_store_counts_and_gradients_exact():
    pytest.importorskip("transformers")
    from .hf_cases import batch, tiny_model

    data = batch(False)
    grads, stats = {}, None
    for mode in ("none", "offload"):
        model = tiny_model("llama")
        store = tiling.checkpoint_layers(model, mode)
        tiles = tiling.tile_mlp(model, 7)
        loss = model(input_ids=data["input_ids"], labels=data["labels"]).loss
        loss.backward()
        grads[mode] = (loss.item(), {n: p.grad for n, p in model.named_parameters()})
        if store is not None:
            stats = store.stats()
            assert [list(t.counts) for t in tiles] == [[7, 7], [7, 7]]  # forward and the re-entrant recompute, 45 tokens / 7
        tiling.uncheckpoint_layers(model)
        tiling.untile_mlp(model)
        assert "forward" not in model.model.layers[0].__dict__ and "mlp" not in model.model.layers[0].__dict__
    # two layers, one saved input each (hidden_states [1, 45, 32] fp32), packed and unpacked once
    assert stats == {"packed": 2, "packed_bytes": 2 * 45 * 32 * 4, "unpacked": 2, "offloaded_bytes": 0}
    assert abs(grads["offload"][0] - grads["none"][0]) / grads["none"][0] < TOL
    for name, g in grads["none"][1].items():
        assert _rel(grads["offload"][1][name], g) < TOL, name


@pytest.mark.parametrize("tiled_mlp,checkpoint,match", [
    (False, "foo", "checkpoint must be one of"),
    (0, "none", "tiled_mlp must be"),
    (-4, "none", "tiled_mlp must be"),
    (2.5, "none", "tiled_mlp must be"),
    ("8k", "layers", "tiled_mlp must be"),
])
def test_bad_options_raise(tiled_mlp, checkpoint, match):
    with pytest.raises(ValueError, match=match):
        tiling.validate_options(tiled_mlp, checkpoint)


def test_bad_options_raise_before_touching_the_model():
    pytest.importorskip("transformers")
    from ulysses_sp.models.switch import apply_sequence_parallel

    from .hf_cases import tiny_model

    model = tiny_model("llama")
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        apply_sequence_parallel(model, topo=None, checkpoint="foo")
    with pytest.raises(ValueError, match="tiled_mlp must be"):
        apply_sequence_parallel(model, topo=None, tiled_mlp=0)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()  # renamed in transformers 5
    with pytest.raises(ValueError, match="replaces transformers' gradient checkpointing"):
        apply_sequence_parallel(model, topo=None, checkpoint="layers")
    assert model.config._attn_implementation == before


def test_default_tile():
    assert tiling.validate_options(True, "none") == 0 and tiling.validate_options(False, "none") is None
    assert tiling.default_tile_tokens(32) == 1024 and tiling.default_tile_tokens(4096) == 4096


# --------------------------------------------------------------------------- spawned


@pytest.mark.parametrize("name", ["ulysses/layers", "ulysses/offload", "allgather/layers", "allgather/offload", "ring/layers",
                                  "ring/offload", "hybrid/layers", "hybrid/offload", "ulysses/offload/packed", "ring/layers/packed"])
def test_hf_tiled_checkpointed_equals_plain(ranks, name):
    pytest.importorskip("transformers")
    from .conftest import values

    results = values(ranks(2), f"tiling/hf/{name}")
    for r in results:
        assert r["loss_rel"] < TOL and r["grad_rel"] < TOL, f"worst parameter {r['worst_param']}: {r['grad_rel']:.3g}"
        assert r["restored"] and r["attn_restored"]
        assert r["counts_all_ranks"][0] == r["counts_all_ranks"][1], r["counts_all_ranks"]
        # 24 local tokens / 5: 5 tiles per forward; "layers" recomputes the forward, "offload" (re-entrant) too
        assert r["counts"] == [[5, 5], [5, 5]], r["counts"]
        if name.split("/")[1] == "offload":
            assert r["offload"]["packed"] == 2 and r["offload"]["unpacked"] == 2, r["offload"]
            assert r["offload"]["packed_bytes"] == 2 * 24 * 32 * 4
        else:
            assert r["offload"] is None


@pytest.mark.parametrize("world", [2, 4])
def test_hf_tiled_norms_equal_plain(ranks, world):
    """The decoder layers' norms and the final one over tiles too, with the MLP: exact against the
    same SP model untiled, every norm call tiled (the final norm runs once per tile), restored after."""
    pytest.importorskip("transformers")
    from .conftest import values

    from .tiling_cases import NORM_CASES

    local = {2: 24, 4: 12}[world]  # 45 tokens padded to a multiple of 2P
    for r in values(ranks(world), "tiling/hf/norms"):
        assert sorted(r) == sorted(NORM_CASES)
        for name, got in r.items():
            assert got["loss_rel"] < TOL and got["grad_rel"] < TOL, (name, got["worst_param"], got["grad_rel"])
            assert got["restored"], name
            # the final norm is outside the checkpointed layers: once per tile in the forward and once per tile in the backward
            assert len(got["norm_calls"]) == 2 * tiling.tile_count(local, 5), (name, len(got["norm_calls"]))


def test_deepspeed_zero_tiled_checkpointed_equals_plain(ranks):
    """SP=2 x DP=2: ZeRO-2 with per-layer checkpointing, ZeRO-3 with offload, ZeRO-3 with DP groups of different lengths."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    from .conftest import values

    results = values(ranks(4), "tiling/deepspeed")
    assert sorted(results[0]) == ["2/layers", "3/layers/uneven", "3/offload"]
    for rank, r in enumerate(results):
        assert r["3/layers/uneven"]["own_tiles"] == (7 if rank < 2 else 6)  # ranks 2, 3: DP rank 1, the shorter sequence
        for run, got in r.items():
            assert got["loss_rel"] < TOL and got["grad_rel"] < TOL and got["param_rel"] < TOL, (run, got)
            assert got["param_moved"] > 1e-3, (run, got)  # the step did something
            # 20 local tokens / 3 per tile = 7 tiles, forward and recompute; uneven: 15 on DP rank 1, still 7 (the world's max)
            assert got["counts"] == [[7, 7], [7, 7]], (run, got["counts"])
            assert (got["offload"] is not None) == run.startswith("3/offload"), got


def test_offload_cuda_path_under_fake_tensors():
    """The CUDA branch of the offload hooks, run with FakeTensorMode CUDA tensors (no GPU here):
    a saved activation goes to a host tensor of the same shape and dtype and comes back to its
    device; parameters stay where they are. Pinning and the copies' overlap need a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ulysses_sp.tiling import OffloadStore

    with FakeTensorMode():
        store = OffloadStore()
        act = torch.empty(2, 16, 8, dtype=torch.bfloat16, device="cuda")
        device, host = store.pack(act)
        assert (device, host.device, host.shape, host.dtype) == (act.device, torch.device("cpu"), act.shape, act.dtype)
        back = store.unpack((device, host))
        assert (back.device, back.shape, back.dtype) == (act.device, act.shape, act.dtype)
        weight = torch.nn.Parameter(torch.empty(4, 4, device="cuda"))
        assert store.unpack(store.pack(weight)) is weight
    assert store.stats() == {"packed": 2, "packed_bytes": 2 * 16 * 8 * 2 + 16 * 4, "unpacked": 2, "offloaded_bytes": 2 * 16 * 8 * 2}


@pytest.mark.parametrize("family,found", [
    ("llama", ["input_layernorm", "post_attention_layernorm"] * 2 + ["norm"]),
    ("gemma2", ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"] * 2 + ["norm"]),
])
def test_norms_found_in_and_beside_the_layers(family, found):
    """What ``tiled_norms`` tiles: every norm of the decoder layers (sandwich norms too) and the final one, not the attention's own."""
    pytest.importorskip("transformers")
    from .hf_cases import tiny_model

    model = tiny_model(family)
    assert sorted(name for _, name in tiling.norms(model)) == sorted(found)
    tiling.tile_norms(model, 3)
    x = torch.randn(1, 10, 32, requires_grad=True)
    layer_norm = model.model.layers[0].input_layernorm  # the stand-in; the module itself stays in _modules
    assert isinstance(layer_norm, tiling.TiledMLP) and model.model.layers[0]._modules["input_layernorm"] is layer_norm.module
    y = layer_norm(x)
    y.square().sum().backward()
    grad_x, grad_w = x.grad.clone(), layer_norm.module.weight.grad.clone()
    x.grad = None
    layer_norm.module.weight.grad = None
    layer_norm.module(x).square().sum().backward()
    assert torch.allclose(y, layer_norm.module(x)) and torch.allclose(grad_x, x.grad, atol=1e-6) and torch.allclose(grad_w, layer_norm.module.weight.grad, atol=1e-5)
    tiling.untile_mlp(model)
    assert not any(isinstance(v, tiling.TiledMLP) for m in model.modules() for v in m.__dict__.values())


def test_tiled_norms_bad_option_and_no_norm_raise():
    pytest.importorskip("transformers")
    from ulysses_sp.models.switch import apply_sequence_parallel

    from .hf_cases import tiny_model

    model = tiny_model("llama")
    with pytest.raises(ValueError, match="tiled_norms must be True or False"):
        apply_sequence_parallel(model, topo=None, tiled_norms=1)
    for layer in model.model.layers:
        layer.input_layernorm = layer.post_attention_layernorm = torch.nn.Identity()
    model.model.norm = torch.nn.Identity()
    with pytest.raises(ValueError, match="tiled_norms: LlamaForCausalLM has no norm"):
        apply_sequence_parallel(model, topo=None, tiled_norms=True)


def test_tiling_and_checkpointing_survive_kernelize(tmp_path):
    """transformers' Hub kernels (on from from_pretrained when `kernels` is installed) re-kernelize at every
    train()/eval() and drop the instance forward of a kernel-decorated class: the norms are such classes in
    transformers 5.25, and here the decoder layers are made one too. The tiles counted in the forward and
    again in the checkpoint's recompute show that tiling and checkpointing are still there."""
    kernels = pytest.importorskip("kernels")
    from transformers import AutoModelForCausalLM

    from ulysses_sp.testing.tiny_checkpoint import write_tiny_llama

    write_tiny_llama(str(tmp_path))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert model.use_kernels, "from_pretrained should turn the Hub kernels on"
    layer_class = type(model.model.layers[0])
    decorated = kernels.use_kernel_forward_from_hub("UlyssesSpTestDecoderLayer")(type("KernelDecoratedDecoderLayer", (layer_class,), {}))
    for layer in model.model.layers:
        layer.__class__ = decorated
    tiled = tiling.tile_mlp(model, 4) + tiling.tile_norms(model, 4)
    tiling.checkpoint_layers(model, "layers")
    model.eval()
    model.train()  # each a kernelize: the decorated layers' instance forwards are dropped
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    n = tiling.tile_count(16, 4)
    final_norm = model.model._modules["norm"]  # outside the checkpointed layers: no recompute
    assert [list(t.counts) for t in tiled] == [[n] if t.module is final_norm else [n, n] for t in tiled], \
        "a tile count per forward, and per recompute within the layers"
