"""The first thing a GPU runs (called by benchmarks/gpu_check.sh): the CUDA kernels and
every backend at P=1 against the math reference, one summary line per check.

    python benchmarks/gpu_check.py            # PASS/FAIL lines; exit 1 if any failed
    python benchmarks/gpu_check.py --ranks 2  # every backend on 2 GPUs with NCCL against one-process math

What it confirms that the CPU suite cannot: the real flash-attn private functions and
torch's CUDA attention ops (signatures, GQA without repeated K/V, flash-attn's +inf lse
for empty rows, bottom-right causal masks for Sq != Sk, varlen lse layout; sliding windows
and soft-capping: flash-attn's and ``_flash_attention_forward``'s window_size, the
memory-efficient op with a per-tile mask, softcap in flash-attn's backward) at bf16
tolerances, and each backend's path through them on one rank with NCCL; and torch.compile
on CUDA: Inductor's Triton code around the SP attention op in compiled layers (one GPU) and
every backend compiled with NCCL (``--ranks``); the memory model's predicted peak against the
CUDA allocator's at the longest length it predicts for a 1B-class model.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

import ulysses_sp as usp
from ulysses_sp import kernels

RESULTS: list[bool] = []
TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def check(name: str):
    def run(fn):
        t0 = time.perf_counter()
        try:
            detail = fn() or ""
            RESULTS.append(True)
            print(f"PASS {name} ({time.perf_counter() - t0:.1f} s) {detail}", flush=True)
        except Exception as e:  # report and go on: one line per check
            RESULTS.append(False)
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc(file=sys.stderr)
        return fn

    return run


def rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1)).item()


def inputs(sq, sk, hq, hkv, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(2, sq, hq, d, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(2, sk, hkv, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    return q, k, v, torch.randn_like(q)


CASES = {  # name: (Sq, Sk, q heads, kv heads, head dim, causal, varlen lengths or None, window, softcap)
    "square-causal-gqa": (1024, 1024, 16, 4, 128, True, None, None, 0.0),
    "keys-longer-causal": (256, 1024, 8, 8, 64, True, None, None, 0.0),
    "queries-longer-causal (empty rows)": (1024, 256, 8, 2, 64, True, None, None, 0.0),
    "full-d40 (padded head dim)": (512, 768, 8, 1, 40, False, None, None, 0.0),
    "varlen-causal-with-empty": (1024, 1024, 8, 2, 128, True, ((300, 0, 500, 224), (300, 100, 0, 624)), None, 0.0),
    "sliding-causal-gqa (W=256)": (1024, 1024, 16, 4, 128, True, None, (255, 0), 0.0),
    "band-queries-longer (empty rows)": (1024, 256, 8, 2, 64, False, None, (64, 32), 0.0),
    "open-right-queries-longer (tiles)": (1024, 256, 8, 2, 64, False, None, (64, -1), 0.0),
    "varlen-sliding-with-empty": (1024, 1024, 8, 2, 128, True, ((300, 0, 500, 224), (300, 100, 0, 624)), (127, 0), 0.0),
    "softcap-sliding (Gemma 2)": (1024, 1024, 8, 4, 128, True, None, (255, 0), 1.0),
}


def kernel_checks() -> None:
    names = ["torch"] + (["flash_attn"] if kernels.get_kernel("flash_attn").problem(torch.bfloat16, torch.device("cuda"), 128) is None else [])
    if "flash_attn" not in names:
        print("SKIP flash_attn kernel: " + kernels.get_kernel("flash_attn").problem(torch.bfloat16, torch.device("cuda"), 128), flush=True)
    dtypes = {"torch": (torch.bfloat16, torch.float16, torch.float32), "flash_attn": (torch.bfloat16, torch.float16)}
    math = kernels.get_kernel("math")
    for name in names:
        kernel = kernels.get_kernel(name)
        for dtype in dtypes[name]:
            for case, (sq, sk, hq, hkv, d, causal, lens, window, softcap) in CASES.items():

                @check(f"kernel {name} {str(dtype)[6:]} {case}")
                def _():
                    q, k, v, dout = inputs(sq, sk, hq, hkv, d, dtype)
                    varlen = kernels.Varlen.build(*lens, batch=2, device="cuda") if lens else None
                    opts = dict(causal=causal, scale=d**-0.5, varlen=varlen, window=window, softcap=softcap)
                    out, lse = kernel.block_forward(q, k, v, **opts)
                    ref, ref_lse = math.block_forward(q, k, v, **opts)
                    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == ref_lse.shape
                    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "empty rows differ (lse must be -inf there)"
                    finite = torch.isfinite(ref_lse)
                    errs = [rel(out, ref), (lse[finite] - ref_lse[finite]).abs().max().item()]
                    got = kernel.block_backward(dout, q, k, v, out, lse, **opts)
                    want = math.block_backward(dout, q, k, v, ref.to(dtype), ref_lse, **opts)
                    errs += [rel(g, w) for g, w in zip(got, want)]
                    assert max(errs) < TOL[dtype], f"errors out/lse/dq/dk/dv {[f'{e:.2e}' for e in errs]}"
                    return "errors " + " ".join(f"{e:.1e}" for e in errs)


def backend_checks() -> None:
    topo = usp.init_sequence_parallel(1)
    for backend in usp.list_backends():
        for kernel in ("auto", "torch"):

            @check(f"backend {backend} P=1 kernel={kernel} bf16 packed")
            def _():
                q, k, v, dout = inputs(2048, 2048, 16, 4, 128, torch.bfloat16, seed=1)
                cu = torch.tensor([0, 100, 1000, 1024, 2048], device="cuda")
                window = 512 if backend == "halo" else None  # halo runs windowed layers only
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                out = usp.sp_attention(*leaves, topo, backend=backend, kernel=kernel, cu_seqlens=cu, window=window)
                out.backward(dout)
                ref_leaves = [t.double().clone().requires_grad_() for t in (q, k, v)]
                ref = usp.sp_attention(*ref_leaves, topo, backend=backend, kernel="math", cu_seqlens=cu, window=window)
                ref.backward(dout.double())
                errs = [rel(out, ref)] + [rel(a.grad, b.grad) for a, b in zip(leaves, ref_leaves)]
                assert max(errs) < TOL[torch.bfloat16], f"errors {errs}"
                return f"kernel {usp.attention.make_spec(q, k, v, topo, kernel=kernel).kernel}; errors " + " ".join(f"{e:.1e}" for e in errs)

        @check(f"backend {backend} P=1 kernel=auto bf16 packed, learned sinks (GPT-OSS)")
        def _():
            q, k, v, dout = inputs(2048, 2048, 16, 4, 128, torch.bfloat16, seed=2)
            cu = torch.tensor([0, 100, 1000, 1024, 2048], device="cuda")
            window = 128 if backend == "halo" else None
            sinks = torch.randn(16, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3)) + 1.0
            leaves = [t.clone().requires_grad_() for t in (q, k, v)] + [sinks.clone().requires_grad_()]
            out = usp.sp_attention(*leaves[:3], topo, backend=backend, cu_seqlens=cu, window=window, sinks=leaves[3])
            out.backward(dout)
            ref_leaves = [t.double().clone().requires_grad_() for t in (q, k, v, sinks)]
            ref = usp.sp_attention(*ref_leaves[:3], topo, backend=backend, kernel="math", cu_seqlens=cu, window=window, sinks=ref_leaves[3])
            ref.backward(dout.double())
            errs = [rel(out, ref)] + [rel(a.grad, b.grad) for a, b in zip(leaves, ref_leaves)]
            assert max(errs) < TOL[torch.bfloat16], f"errors out/dq/dk/dv/dsinks {errs}"
            return "errors " + " ".join(f"{e:.1e}" for e in errs)


def autocast_checks() -> None:
    """Attention as a model under CUDA bf16 autocast hands it over (fp32 q and k after RoPE, a bf16 v): computed
    in bf16 with the installed kernel, as SDPA computes it under autocast."""
    topo = usp.init_sequence_parallel(1)
    for backend in usp.list_backends():

        @check(f"autocast bf16: {backend} P=1 on fp32 q, k and a bf16 v == SDPA under autocast")
        def _():
            q, k, v, dout = inputs(1024, 1024, 16, 4, 128, torch.float32, seed=2)
            window = 256 if backend == "halo" else None
            leaves = [q.clone().requires_grad_(), k.clone().requires_grad_(), v.bfloat16().requires_grad_()]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = usp.sp_attention(*leaves, topo, backend=backend, window=window)
            assert out.dtype == torch.bfloat16, f"output {out.dtype}"
            out.backward(dout.bfloat16())
            ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
            mask = None if window is None else torch.ones(1024, 1024, dtype=torch.bool, device="cuda").tril().triu(-(window - 1))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                ref = torch.nn.functional.scaled_dot_product_attention(
                    *(t.transpose(1, 2) for t in ref_leaves), attn_mask=mask, is_causal=mask is None, enable_gqa=True).transpose(1, 2)
            ref.backward(dout.bfloat16())
            errs = [rel(out.float(), ref.float())] + [rel(a.grad.float(), b.grad.float()) for a, b in zip(leaves, ref_leaves)]
            assert max(errs) < TOL[torch.bfloat16], f"errors {errs}"
            return "errors " + " ".join(f"{e:.1e}" for e in errs)


def mla_checks() -> None:
    """Multi-head latent attention at DeepSeek-V3's head dims (query/key 192, value 128): V padded to 192
    for the real kernels (flash-attn takes one head dim), bf16 against fp64 math; and
    verify_sequence_parallel on a shrunk DeepSeek-V3 in fp64 on the GPU."""
    topo = usp.init_sequence_parallel(1)
    for backend in ("ulysses", "ring"):

        @check(f"mla {backend} P=1 kernel=auto bf16 qk 192 / v 128")
        def _():
            q, k, _, _ = inputs(1024, 1024, 16, 16, 192, torch.bfloat16, seed=2)
            v = torch.randn(2, 1024, 16, 128, device="cuda", dtype=torch.bfloat16)
            dout = torch.randn(2, 1024, 16, 128, device="cuda", dtype=torch.bfloat16)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = usp.sp_attention(*leaves, topo, backend=backend)
            out.backward(dout)
            ref_leaves = [t.double().clone().requires_grad_() for t in (q, k, v)]
            ref = usp.sp_attention(*ref_leaves, topo, backend=backend, kernel="math")
            ref.backward(dout.double())
            errs = [rel(out, ref)] + [rel(a.grad, b.grad) for a, b in zip(leaves, ref_leaves)]
            assert out.shape[-1] == 128 and max(errs) < TOL[torch.bfloat16], f"errors {errs}"
            return "errors " + " ".join(f"{e:.1e}" for e in errs)

    @check("verify_sequence_parallel DeepSeek-V3 (shrunk) fp64 on the GPU")
    def _():
        import transformers

        return str(usp.verify_sequence_parallel(transformers.DeepseekV3Config(), topo))


def hybrid_checks(topo=None, rank: int = 0) -> None:
    """Hybrid models under each mixer strategy on the GPU: verify_sequence_parallel on shrunk
    Qwen3-Next (Gated DeltaNet), Bamba (Mamba2) and Kimi Linear (Kimi Delta Attention) under ulysses,
    allgather and state (at P=1 too: zigzag gives the rank two fragments to fold), LFM2 (short convolutions) under halo, allgather and state, MiniMax (lightning attention) under allgather and state,
    and each under auto (whatever it picks at this shape), in fp64, with whatever kernels the machine has (fla,
    mamba_ssm and causal-conv1d when installed, which transformers picks for the functions the
    adapters call; else transformers' torch code); on NCCL ranks, over the whole group (rank 0 prints)."""
    import transformers

    topo = topo or usp.init_sequence_parallel(1)
    models = {"Qwen3NextConfig": ({}, ("ulysses", "allgather", "state")), "BambaConfig": ({}, ("ulysses", "allgather", "state")),
              "Lfm2Config": ({"layer_types": ["conv", "full_attention"], "num_hidden_layers": 2}, ("halo", "allgather", "state")),
              "KimiLinearConfig": ({}, ("ulysses", "allgather", "state")), "MiniMaxConfig": ({}, ("allgather", "state"))}
    for cls, (overrides, strategies) in models.items():
        for mixer in (*strategies, "auto"):
            def ran(report, mixer=mixer):
                assert report.mixers and (mixer == "auto" or set(report.mixers.values()) == {mixer}), report.mixers

            _verify_on_every_rank(f"verify {cls[:-6]} (shrunk, {mixer} mixer) fp64 P={topo.sp_size} on the GPU", rank, ran,
                                  lambda cls=cls, overrides=overrides, mixer=mixer: usp.verify_sequence_parallel(
                                      getattr(transformers, cls)(**overrides), topo, mixer=mixer))


def _verify_on_every_rank(name: str, rank: int, inspect, run) -> None:
    """``run()`` (a verify) on every rank of the group; rank 0 reports it as check ``name``, after ``inspect(report)``."""
    if rank:
        try:
            run()
        except Exception:  # rank 0 reports it
            pass
        return

    @check(name)
    def _():
        report = run()
        inspect(report)
        return str(report)


def vlm_checks(topo=None, rank: int = 0) -> None:
    """Image-text models on the GPU: verify_sequence_parallel on shrunk Qwen2.5-VL (patch rows, the
    window attention of its vision tower), Qwen3-VL (deepstack), LLaVA (CLIP), InternVL (tiles), Mistral 3
    (Pixtral's tower, image_sizes), GLM-4.1V (its 3-D positions) and Gemma 3 (bidirectional image blocks) with random images,
    fp64, each image encoded on one rank and its features sent to the ranks holding its tokens (NCCL's
    uneven all-to-all); on NCCL ranks over the whole group (rank 0 prints)."""
    import transformers

    topo = topo or usp.init_sequence_parallel(1)
    for cls in ("Qwen2_5_VLConfig", "Qwen3VLConfig", "LlavaConfig", "InternVLConfig", "Mistral3Config", "Glm4vConfig", "Gemma3Config"):
        _verify_on_every_rank(f"verify {cls[:-6]} (shrunk, random images) fp64 P={topo.sp_size} on the GPU", rank, lambda report: None,
                              lambda cls=cls: usp.verify_sequence_parallel(getattr(transformers, cls)(), topo))


def dsa_checks(topo=None, rank: int = 0) -> None:
    """DeepSeek Sparse Attention on the GPU: verify_sequence_parallel on shrunk DeepSeek-V3.2 and Hy4 (shared indexer
    layers, sinks), fp64, the latent KV and the indexer's keys all-gathered over NCCL, the indexer's top-k on CUDA (its
    order among tied scores is CUDA's); and DeepSeek-V4 (compressed strategy, unpacked): its halos point to point and
    compressed entries all-gathered over NCCL; on NCCL ranks over the whole group (rank 0 prints)."""
    import transformers

    topo = topo or usp.init_sequence_parallel(1)
    for cls in ("DeepseekV32Config", "HYV4Config", "DeepseekV4Config"):
        _verify_on_every_rank(f"verify {cls[:-6]} (shrunk, its own strategy) fp64 P={topo.sp_size} on the GPU", rank,
                              lambda report: None, lambda cls=cls: usp.verify_sequence_parallel(getattr(transformers, cls)(), topo))


def _llama_bf16():
    """A 2-layer Llama (vocabulary 32000, hidden 256, 8/2 heads) in bf16 on the GPU, one rank's
    topology, and an 8k-token batch."""
    import transformers

    topo = usp.init_sequence_parallel(1)
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, head_dim=32, use_cache=False)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config).cuda().bfloat16()
    ids = torch.randint(0, 32000, (1, 8192))
    batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in usp.shard_batch({"input_ids": ids, "labels": ids.clone()}, topo).items()}
    return topo, ref, batch


def dropout_checks() -> None:
    """Dropout per SP rank on the GPU's generator: ranks 0 and 1 draw different masks, a replay from the
    same CPU and CUDA states draws the same one (what a checkpoint's recomputation does), and the
    CUDA generator is left as it was."""
    import torch.nn.functional as F

    from ulysses_sp.dropout import RankDropout

    @check("dropout per SP rank on the CUDA generator")
    def _():
        x = torch.ones(1 << 20, device="cuda")
        cpu, cuda = torch.get_rng_state(), torch.cuda.get_rng_state()
        masks = []
        for rank in (0, 1, 0):
            torch.set_rng_state(cpu)
            with RankDropout(rank):
                masks.append(F.dropout(x, 0.5) != 0)
        assert torch.equal(torch.cuda.get_rng_state(), cuda), "the CUDA generator moved"
        assert torch.equal(masks[0], masks[2]), "a replay drew another mask"
        assert not torch.equal(masks[0], masks[1]), "ranks 0 and 1 drew the same mask"
        kept = masks[0].float().mean().item()
        assert abs(kept - 0.5) < 0.01, kept
        return f"kept {kept:.4f}"


def memory_checks() -> None:
    """The memory stack on one GPU, bf16: the tiled loss, the tiled MLP and offloaded
    checkpoints give the untiled gradients, and offload really moves bytes to the host."""
    import copy

    from ulysses_sp import tiling

    topo, ref, batch = _llama_bf16()

    @check("memory stack bf16: tiled loss + tiled MLP + offload == plain")
    def _():
        model = copy.deepcopy(ref)
        usp.apply_sequence_parallel(ref, topo)
        usp.sp_cross_entropy(ref(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits, batch["shift_labels"], topo).backward()
        usp.apply_sequence_parallel(model, topo, tiled_mlp=1024, checkpoint="offload")
        usp.causal_lm_loss(model, batch, topo).backward()
        errs = [rel(p.grad.float(), q.grad.float()) for p, q in zip(model.parameters(), ref.parameters())]
        moved = tiling.offload_store(model).stats()["offloaded_bytes"]
        assert max(errs) < TOL[torch.bfloat16] and moved > 0, f"worst gradient error {max(errs):.2e}, offloaded bytes {moved}"
        return f"worst gradient error {max(errs):.1e}; {moved / 2**20:.1f} MiB offloaded to host"


LLAMA_1B = dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=131072)
"""Llama-3.2-1B's shape."""
STEP_MEMORY_CAP = float(os.environ.get("GPU_CHECK_STEP_MEMORY_GIB", "16"))
"""The budget the memory model's longest sequence is sought under (GiB): the step at that length must run in seconds."""


def step_memory_checks() -> None:
    """The memory model (ulysses_sp.step_memory) against torch.cuda.max_memory_allocated: a
    Llama-3.2-1B-shaped model in bf16 with AdamW, every switch on (checkpoints really offloaded to
    pinned host memory), at the longest length the model says fits STEP_MEMORY_CAP GiB; the
    prediction comes from a process of its own (the meta device, the fake process group)."""
    import json
    import subprocess

    import transformers

    code = ("import json, torch; from ulysses_sp import step_memory as sm; "
            f"n, b = sm.max_seq_len({LLAMA_1B!r}, int({STEP_MEMORY_CAP} * 2**30), None, sm.World(1), sm.Engine('none'), sm.Switches(), torch.bfloat16); "
            "print(json.dumps({'seq': n, **b.as_dict()}))")

    @check(f"memory model: predicted peak within 10% of max_memory_allocated (Llama-1B shape, bf16, longest under {STEP_MEMORY_CAP:g} GiB)")
    def _():
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-2000:]
        predicted = json.loads(done.stdout.strip().splitlines()[-1])
        topo = usp.init_sequence_parallel(1)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**LLAMA_1B), attn_implementation="sdpa")
        model = model.to("cuda", torch.bfloat16).train()
        usp.apply_sequence_parallel(model, topo, backend="ulysses", tiled_mlp=True, checkpoint="offload", tiled_norms=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
        ids = torch.randint(0, LLAMA_1B["vocab_size"], (1, predicted["seq"]))
        batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in usp.shard_batch({"input_ids": ids, "labels": ids.clone()}, topo).items()}
        t0 = time.perf_counter()
        for step in range(2):
            if step:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            usp.causal_lm_loss(model, batch, topo).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - base
        err = abs(measured - predicted["peak"]) / measured
        del model, optimizer, batch
        torch.cuda.empty_cache()
        assert err < 0.10, f"predicted {predicted['peak'] / 2**30:.2f} GiB, measured {measured / 2**30:.2f} GiB at {predicted['seq']} tokens"
        return (f"{predicted['seq']} tokens: predicted {predicted['peak'] / 2**30:.2f} GiB, measured {measured / 2**30:.2f} GiB ({err:.1%}); "
                f"two steps {time.perf_counter() - t0:.0f} s")


def compile_checks() -> None:
    """Decoder layers under torch.compile on one GPU, bf16 (Inductor's Triton code around the SP
    attention op, layer checkpointing around the compiled layer): the eager gradients."""
    import copy

    from ulysses_sp import tiling

    topo, ref, batch = _llama_bf16()

    @check("compiled layers bf16 (checkpointed, tiled MLP) == eager")
    def _():
        grads = []
        for compiled in (False, True):
            model = usp.apply_sequence_parallel(copy.deepcopy(ref), topo, tiled_mlp=1024, checkpoint="layers")
            if compiled:
                tiling.compile_layers(model, fullgraph=True)
            usp.causal_lm_loss(model, batch, topo).backward()
            grads.append([p.grad.float() for p in model.parameters()])
        errs = [rel(a, b) for a, b in zip(grads[1], grads[0])]
        assert max(errs) < TOL[torch.bfloat16], f"worst gradient error {max(errs):.2e}"
        return f"worst gradient error {max(errs):.1e}"


def kernel_rate(n: int, device, dtype=torch.bfloat16, repeat: int = 3) -> float:
    """Forward+backward FLOP/s of the local kernel (causal, 32/8 heads x 128) on ``n`` tokens:
    the backward counted as 2.5 forwards, a causal forward as 4 n^2 H D / 2."""
    q = torch.randn(1, n, 32, 128, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, n, 8, 128, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    step = lambda: kernels.local_attention(q, k, v, causal=True).sum().backward()  # noqa: E731
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    step()  # warm-up
    sync()
    t0 = time.perf_counter()
    for _ in range(repeat):
        step()
    sync()
    return 3.5 * 4 * n * n * 32 * 128 / 2 / ((time.perf_counter() - t0) / repeat)


def half_rate_fit(rates: dict) -> int:
    """The n0 (0 to 4000, step 10) whose n / (n + n0), relative to the longest length's, fits
    ``rates`` (tokens: FLOP/s) best."""
    top = max(rates)
    return min(range(0, 4001, 10), key=lambda n0: sum((n / (n + n0) / (top / (top + n0)) - rates[n] / rates[top]) ** 2 for n in rates))


def efficiency_checks() -> None:
    """The built-in GPU profile's block-size term on this GPU: the local kernel's forward+backward
    rate (bf16, causal, 32/8 heads x 128) at 512 to 16k tokens, against the profile's
    n / (n + kernel_half_rate_tokens) (fitted to flash-attn 2's published H100 curve). Prints the
    measured rates and the n0 that fits them; fails when a ratio to the 16k rate is off by over 25%."""
    from ulysses_sp.profile import NVLINK_PROFILE

    lengths = (512, 1024, 2048, 4096, 8192, 16384)

    @check("kernel rate against the GPU profile's block-size term (bf16 causal 32/8 x 128)")
    def _():
        rates = {n: kernel_rate(n, "cuda", repeat=max(3, 16384 // n)) for n in lengths}
        modelled = {n: NVLINK_PROFILE.efficiency("ulysses", n) / NVLINK_PROFILE.efficiency("ulysses", lengths[-1]) for n in lengths}
        worst = max(abs(rates[n] / rates[lengths[-1]] / modelled[n] - 1) for n in lengths)
        detail = (", ".join(f"{n}: {rates[n] / 1e12:.0f}" for n in lengths)
                  + f" TFLOP/s; n0 fitted here {half_rate_fit(rates)} (profile {NVLINK_PROFILE.kernel_half_rate_tokens:.0f})")
        assert worst < 0.25, f"a rate ratio is {worst:.0%} off the profile's curve: {detail}"
        return detail


PARITY = {  # name: (q heads, kv heads, causal, documents of the 4096 tokens or None, sliding window or None, softcap, learned sinks)
    "gqa-causal": (16, 4, True, None, None, 0.0, False),
    "mqa-full": (8, 1, False, None, None, 0.0, False),
    "gqa-causal-packed": (16, 4, True, (0, 300, 1500, 1501, 4096), None, 0.0, False),
    "gqa-window1000": (16, 4, True, None, 1000, 0.0, False),
    "gqa-window300-packed-softcap": (16, 4, True, (0, 300, 1500, 1501, 4096), 300, 20.0, False),
    "gqa-window128-packed-sinks (GPT-OSS)": (16, 4, True, (0, 300, 1500, 1501, 4096), 128, 0.0, True),
}


def _reference(full, causal, cu, window, softcap, sinks=None):
    """fp64 out and dq, dk, dv of the whole sequence with the math kernel on this GPU."""
    lens = None if cu is None else [b - a for a, b in zip(cu, cu[1:])]
    varlen = None if cu is None else kernels.Varlen.build(lens, lens, 1, "cuda")
    leaves = [t.double().requires_grad_() for t in full[:3]]
    out = kernels.attend(*leaves, kernel="math", causal=causal, scale=full[0].shape[-1] ** -0.5, varlen=varlen,
                         window=None if window is None else (window - 1, 0), softcap=softcap, sinks=None if sinks is None else sinks.double())
    out.backward(full[3].double())
    return [out.detach()] + [t.grad for t in leaves]


def parity_rank(rank: int, world: int, port: int) -> None:
    """Every backend (and ulysses-g2, the all-to-alls pipelined over 2 head groups on side streams,
    and hybrid-u2 on 8 GPUs, where it is not the topology's degree) x layout x kernel (and the auto
    kernel under torch.compile) x case (windows and soft-capping included) on ``world`` GPUs with
    NCCL, bf16, against fp64 one-process attention;
    rank 0 prints one line per combination (the worst rank's error), then the pipeline's timing."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    ud = 2 if world % 2 == 0 and world > 2 else None
    for layout in ("zigzag", "contiguous", "balanced"):
        topo = usp.init_sequence_parallel(world, layout=layout, ulysses_degree=ud)
        for case, (hq, hkv, causal, cu, window, softcap, with_sinks) in PARITY.items():
            if layout == "balanced" and cu is None:  # the placement matters for packed rows; one document runs the same code
                continue
            docs = cu or (0, 4096)
            g = torch.Generator(device="cuda").manual_seed(7)
            full = [torch.randn(1, 4096, h, 128, device="cuda", generator=g).bfloat16() for h in (hq, hkv, hkv, hq)]
            sinks = torch.randn(hq, device="cuda", generator=g) + 1.0 if with_sinks else None
            want = _reference(full, causal, cu, window, softcap, sinks)
            for backend in usp.list_backends() + ["ulysses-g2"] + (["hybrid-u2"] if world == 8 else []):
                if backend == "halo" and window is None:  # halo runs windowed layers only
                    continue
                for kernel, compiled in (("auto", False), ("torch", False), ("auto", True)):
                    name = f"nccl P={world} {backend} {layout} kernel={kernel}{' compiled' if compiled else ''} bf16 {case}"
                    try:
                        shards = [usp.shard_sequence(t, topo, cu_seqlens=docs).requires_grad_() for t in full[:3]]
                        torch._dynamo.reset()  # the compiled form: one graph per combination, no recompile limit
                        attention = torch.compile(usp.sp_attention, fullgraph=True) if compiled else usp.sp_attention
                        out = attention(*shards, topo, backend=backend, kernel=kernel, causal=causal, window=window, softcap=softcap,
                                        cu_seqlens=None if cu is None else torch.tensor(cu, device="cuda"), sinks=sinks)
                        out.backward(usp.shard_sequence(full[3], topo, cu_seqlens=docs))
                        got = [usp.gather_sequence(t, topo, cu_seqlens=docs) for t in (out.detach(), *(s.grad for s in shards))]
                        errs = torch.tensor([rel(a, b) for a, b in zip(got, want)], device="cuda")
                    except Exception as e:  # every rank fails alike for bad input; report, go on
                        errs = torch.full((4,), float("inf"), device="cuda")
                        if rank == 0:
                            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                            RESULTS.append(False)
                        continue
                    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
                    if rank == 0:
                        ok = bool(errs.max() < TOL[torch.bfloat16])
                        RESULTS.append(ok)
                        print(f"{'PASS' if ok else 'FAIL'} {name}: errors out/dq/dk/dv " + " ".join(f"{e:.1e}" for e in errs.tolist()), flush=True)
    hybrid_checks(usp.init_sequence_parallel(world), rank)
    vlm_checks(usp.init_sequence_parallel(world), rank)
    dsa_checks(usp.init_sequence_parallel(world), rank)
    pipeline_timing(rank, world)
    dist.destroy_process_group()
    if rank == 0:
        print(f"gpu_check nccl: {sum(RESULTS)} passed, {len(RESULTS) - sum(RESULTS)} failed", flush=True)
        if not all(RESULTS):
            sys.exit(1)


def pipeline_timing(rank: int, world: int) -> None:
    """Ulysses over 1, 2 and 4 head groups, bf16 H32/KV8 D128 causal, 32k tokens per GPU: the
    median of 5 fwd+bwd (slowest rank, CUDA-synchronised), and each against one group. A figure
    (INFO), not a check: whether the side streams hide the all-to-alls on this machine."""
    topo = usp.init_sequence_parallel(world)
    g = torch.Generator(device="cuda").manual_seed(3)
    seq = 32768 * world
    q, k, v, dout = (usp.shard_sequence(torch.randn(1, seq, h, 128, device="cuda", generator=g).bfloat16(), topo) for h in (32, 8, 8, 32))
    times = {}
    for groups in (1, 2, 4, 1, 2, 4):  # the first pass warms up
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        runs = []
        for _ in range(5):
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            usp.sp_attention(*leaves, topo, backend=f"ulysses-g{groups}").backward(dout)
            torch.cuda.synchronize()
            took = torch.tensor(time.perf_counter() - t0, device="cuda")
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            runs.append(took.item())
        times[groups] = sorted(runs)[2]
    if rank == 0:
        print(f"INFO ulysses head groups, {seq} tokens on {world} GPUs: " + ", ".join(
            f"G={g} {1e3 * t:.1f} ms ({t / times[1]:.3f} of G=1)" for g, t in times.items()), flush=True)


def stream_checks() -> None:
    """The side stream of pipelined backends (``ulysses_sp.streams.CommStream``) on one GPU: work
    queued there after large compute-stream work sees its result, and compute-stream work after
    ``join`` sees the side stream's; a missing wait would read stale values."""
    from ulysses_sp.streams import CommStream

    @check("comm stream: side work ordered after compute, compute after join")
    def _():
        stream = CommStream(torch.device("cuda"))
        x = torch.zeros(64 << 20, device="cuda")
        for i in range(1, 6):
            x.add_(1).mul_(1)  # queued on the compute stream; long enough to race a side-stream read
            with stream.side():
                y = x * 2  # must see x == i
            stream.join(y)
            got = (y.sum() / y.numel()).item()
            assert got == 2 * i, f"round {i}: side stream read {got / 2}, not {i}"
        return "5 rounds"


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIP no GPU")
        return 0
    if "--ranks" in sys.argv:
        world = min(int(sys.argv[sys.argv.index("--ranks") + 1]), torch.cuda.device_count())
        torch.multiprocessing.spawn(parity_rank, args=(world, 29512), nprocs=world)  # raises if a rank failed
        return 0
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    kernel_checks()
    backend_checks()
    autocast_checks()
    mla_checks()
    hybrid_checks()
    vlm_checks()
    dsa_checks()
    stream_checks()
    memory_checks()
    step_memory_checks()
    dropout_checks()
    compile_checks()
    efficiency_checks()
    dist.destroy_process_group()
    print(f"gpu_check: {sum(RESULTS)} passed, {len(RESULTS) - sum(RESULTS)} failed", flush=True)
    return 0 if all(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
