"""The memory model (``ulysses_sp.step_memory``) against measurement: one training step of a tiny
Llama-shaped model on real CPU tensors in the spawned ranks, every allocation counted by
``PeakMemory``, beside the model's prediction for the same step (made on the meta device, in a
process of its own: ``python tests/step_memory_cases.py OUT.json``)."""

from __future__ import annotations

import json
import sys

import torch

CONFIG = dict(model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=4, head_dim=16, max_position_embeddings=8192, tie_word_embeddings=False, use_cache=False)
SEQ = 2048
TILE = 128
"""The MLP's and norms' tile: 1/8 of a rank's 1024 tokens at P=2."""
SWITCHES = {
    "plain": dict(tiled_loss=False, tiled_mlp=False, checkpoint="none", tiled_norms=False),
    "loss": dict(tiled_loss=True, tiled_mlp=False, checkpoint="none", tiled_norms=False),
    "loss+mlp+norms": dict(tiled_loss=True, tiled_mlp=TILE, checkpoint="none", tiled_norms=True),
    "all+layers": dict(tiled_loss=True, tiled_mlp=TILE, checkpoint="layers", tiled_norms=True),
    "all+offload": dict(tiled_loss=True, tiled_mlp=TILE, checkpoint="offload", tiled_norms=True),
    "all+layers+g2": dict(tiled_loss=True, tiled_mlp=TILE, checkpoint="layers", tiled_norms=True, head_groups=2),
}
HYBRID = dict(CONFIG, model_type="qwen3_5_text", num_hidden_layers=6, linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=16, layer_types=["linear_attention", "linear_attention", "full_attention"] * 2)
"""Qwen3.5-shaped: Gated DeltaNet and attention layers, extrapolated by kind."""
WORLDS = (2, 4)
DS_SWITCHES = dict(tiled_loss=True, tiled_mlp=False, checkpoint="layers", tiled_norms=False)
"""Few module calls: ZeRO-3 gathers parameters per call, and each call is slow under PeakMemory."""
DS_ZERO = {"reduce_bucket_size": 100_000, "stage3_max_live_parameters": 200_000, "stage3_prefetch_bucket_size": 50_000}
"""DeepSpeed's buckets at this model's scale (its defaults would allocate 1 GB), as the model is told."""
DS_RUNS = {"zero3": False, "zero3+offload": True}
AT_4 = ("plain", "all+offload", "all+layers+g2")
"""The switch sets measured at P=4 too (every one at P=2)."""


def switch_sets(world: int) -> dict:
    return SWITCHES if world == 2 else {name: SWITCHES[name] for name in AT_4}


def measured(topo, switches: dict) -> dict:
    """Rank's peak bytes over a second training step (AdamW, foreach, as on CUDA), counting the
    model, its gradients and optimizer states; and the bytes the offload store took per step.
    Offloaded checkpoints leave the device as on CUDA: the store's host copies are made where
    ``PeakMemory`` does not count them, and the copies back are counted."""
    import transformers
    from torch.utils._python_dispatch import _disable_current_modes

    import ulysses_sp as usp
    from ulysses_sp.step_memory import Switches
    from ulysses_sp.testing.memory import PeakMemory
    from ulysses_sp.tiling import offload_store

    sw = Switches(**switches)
    torch.manual_seed(0)
    with PeakMemory() as memory:
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**CONFIG), attn_implementation="sdpa").train()
        usp.apply_sequence_parallel(model, topo, backend=sw.backend_name, tiled_mlp=sw.tiled_mlp, checkpoint=sw.checkpoint, tiled_norms=sw.tiled_norms)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        ids = torch.randint(0, CONFIG["vocab_size"], (1, SEQ))
        batch = usp.shard_batch({"input_ids": ids, "labels": ids.clone()}, topo)
        store, offloaded = offload_store(model), [0]
        if store is not None:
            def pack(t):
                offloaded[0] += t.numel() * t.element_size()
                with _disable_current_modes():
                    return t.detach().clone()
            store.pack, store.unpack = pack, torch.clone
        for step in range(2):
            if step:  # the steady state: optimizer states exist from the first step
                memory.peak, offloaded[0] = memory.live, 0
            if sw.tiled_loss:
                loss = usp.causal_lm_loss(model, batch, topo)
            else:
                loss = usp.sp_cross_entropy(model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits, batch["shift_labels"], topo)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del loss
    return {"peak": memory.peak, "offloaded_bytes": offloaded[0]}


def measured_deepspeed(topo, offload: bool) -> dict:
    """As :func:`measured` through a DeepSpeed ZeRO-3 engine in bf16 (torch's AdamW on its fp32
    partition, optionally offloaded: on CPU that host memory is counted with the rest)."""
    import os
    import tempfile

    import deepspeed
    import transformers

    import ulysses_sp as usp
    from ulysses_sp.integrations.deepspeed import SequenceParallelMPU, gradient_scale, use_cpu_accelerator_if_needed
    from ulysses_sp.testing.memory import PeakMemory

    use_cpu_accelerator_if_needed()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(tempfile.gettempdir(), "usp-torch-extensions"))
    zero = {"stage": 3, **DS_ZERO, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    # torch's AdamW, not DeepSpeed's: its CPU ops would be compiled first (minutes on a fresh machine)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": zero, "steps_per_print": 10**9,
              "bf16": {"enabled": True}, "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}
    torch.manual_seed(0)
    with PeakMemory() as memory:
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**CONFIG), attn_implementation="sdpa").train()
        sw = DS_SWITCHES
        usp.apply_sequence_parallel(model, topo, backend="ulysses", tiled_mlp=sw["tiled_mlp"], checkpoint=sw["checkpoint"], tiled_norms=sw["tiled_norms"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=SequenceParallelMPU(topo))
        ids = torch.randint(0, CONFIG["vocab_size"], (1, SEQ))
        batch = usp.shard_batch({"input_ids": ids, "labels": ids.clone()}, topo)
        for step in range(2):
            if step:
                memory.peak = memory.live
            loss = usp.causal_lm_loss(engine, batch, topo)
            engine.backward(loss * gradient_scale(engine, topo))
            engine.step()
            del loss
        engine.destroy()
    return {"peak": memory.peak}


def predict() -> dict:
    """Every switch set's :class:`Breakdown` at P = 2 and 4 (one fake process group each), ZeRO-3's
    at P=2, the extrapolation from 1 and 2 layers against the whole depth (P=2), and the CLI."""
    import torch.distributed as dist

    from ulysses_sp import step_memory as sm

    out = {}
    for world in WORLDS:
        if dist.is_initialized():
            dist.destroy_process_group()
        for name, switches in switch_sets(world).items():
            b = sm.estimate(CONFIG, SEQ, sm.World(gpus_per_node=world), sm.Engine("none"), sm.Switches(**switches), dtype=torch.float32)
            out[f"{world}/{name}"] = b.as_dict()
    dist.destroy_process_group()  # P=4's fake group: ZeRO-3 and the rest at P=2 on a fresh one
    for name, offload in DS_RUNS.items():
        engine = sm.Engine("zero3", offload, reduce_bucket=DS_ZERO["reduce_bucket_size"], max_live_parameters=DS_ZERO["stage3_max_live_parameters"])
        out[f"2/{name}"] = sm.estimate(CONFIG, SEQ, sm.World(gpus_per_node=2), engine, sm.Switches(**DS_SWITCHES), dtype=torch.bfloat16).as_dict()
    config, sw = sm._load_config(CONFIG), sm.Switches(**SWITCHES["all+offload"])
    for keep in (False, True):
        out[f"2/depth/{keep}"] = {"whole": sm._step(config, None, SEQ, 2, sw, torch.float32, keep),
                                  "extrapolated": sm._step_extrapolated(config, SEQ, 2, sw, torch.float32, keep)}
    hybrid = sm._load_config(HYBRID)
    for mixer in ("ulysses", "state"):
        for checkpoint in ("offload", "layers"):
            sw = sm.Switches(mixer=mixer, checkpoint=checkpoint, tiled_mlp=TILE)
            out[f"2/hybrid/{mixer}/{checkpoint}"] = {"whole": sm._step(hybrid, None, SEQ, 2, sw, torch.float32, False),
                                                      "extrapolated": sm._step_extrapolated(hybrid, SEQ, 2, sw, torch.float32, False)}
    dist.destroy_process_group()
    out["cli"] = _cli()
    return out


def _cli() -> dict:
    """``sp-bench plan --max-seq-len`` on this config under a 24 MiB cap at P=2, and the model's
    figure one resolution step beyond its answer."""
    import os
    import tempfile

    from click.testing import CliRunner

    from ulysses_sp import step_memory as sm
    from ulysses_sp.cli.main import main

    with tempfile.TemporaryDirectory() as tmp:
        config, answer = os.path.join(tmp, "config.json"), os.path.join(tmp, "answer.json")
        with open(config, "w") as f:
            json.dump({k: v for k, v in CONFIG.items()}, f)
        result = CliRunner().invoke(main, ["plan", "--model-config", config, "--max-seq-len", "--gpus-per-node", "2", "--engine", "none",
                                           "--gpu-memory", "24MiB", "--host-memory", "none", "--dtype", "float32", "--json", answer])
        got = json.load(open(answer)) if result.exit_code == 0 else None
    beyond = None
    if got:
        n = got["max_seq_len"]
        step = max(4, n // 128 // 4 * 4)
        beyond = sm.estimate(CONFIG, n + step, sm.World(2), sm.Engine("none"), sm.Switches(), torch.float32).peak
    return {"exit_code": result.exit_code, "output": result.output, "answer": got, "beyond_peak": beyond}


if __name__ == "__main__":  # the prediction, in a process of its own (its fake process group)
    with open(sys.argv[1], "w") as f:
        json.dump(predict(), f)
else:
    import importlib.util

    from .cases import Parity, _topo_for, case

    if importlib.util.find_spec("transformers") is not None:
        case("step_memory/measured", WORLDS)(
            lambda env: {name: measured(_topo_for(env, Parity(), "zigzag"), s) for name, s in switch_sets(env.world).items()})
    if importlib.util.find_spec("transformers") is not None and importlib.util.find_spec("deepspeed") is not None:
        case("step_memory/deepspeed", (2,))(
            lambda env: {name: measured_deepspeed(_topo_for(env, Parity(), "zigzag"), offload) for name, offload in DS_RUNS.items()})
