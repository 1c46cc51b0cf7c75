"""Cases that run inside one spawned group of gloo ranks.

Spawning costs seconds of imports per rank, so each world size has one pool of
ranks for the session (tests/conftest.py) and a case runs in it when a test first
asks for its result; the pytest tests then assert on what each rank returned. A
case returns plain data (errors, byte counts, messages); the tolerances and
expected values live in the tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import zlib

import torch
import torch.distributed as dist

import ulysses_sp as usp
from ulysses_sp import comm, layout
from ulysses_sp.backends.allgather import AllGatherBackend
from ulysses_sp.launch import kept_groups
from ulysses_sp.profile import CPU_GLOO_PROFILE, Profile
from ulysses_sp.registry import choose_backend
from ulysses_sp.spec import Estimate

for _stride in (1, 3):
    _strided = AllGatherBackend(heads_k_stride=_stride)
    _strided.name = f"allgather_stride{_stride}"
    usp.register_backend(_strided)

from .reference import reference_attention
from .tiny_model import TinyLM, make_batch

CASES: dict = {}
WORLDS = (1, 2, 3, 4)


def case(name: str, worlds=WORLDS):
    def register(fn):
        CASES[name] = (fn, tuple(worlds))
        return fn

    return register


class Env:
    """What a case gets: this rank, the world size and cached topologies (kept by the pool across cases).

    The topologies share their process groups: one per set of ranks, whatever the layout, SP size
    or Ulysses degree. Each gloo group costs every member a thread that wakes every 10 ms even when
    idle (50 idle groups: 3.8% of a core here), and the ranks held up to 51 groups each before.
    """

    def __init__(self, rank: int, world: int):
        self.rank, self.world, self._topos, self._groups = rank, world, {}, {}

    def topo(self, sp_size=None, layout="zigzag", ulysses_degree=None):
        sp = sp_size or self.world
        key = (sp, layout, ulysses_degree or sp)
        if key not in self._topos or not _alive(self._topos[key]):
            if not all(_alive(t) for t in self._topos.values()):  # a case destroyed groups: start afresh
                self._topos.clear()
                self._groups.clear()
            usp.layout.check_layout(layout)
            with kept_groups(), _reused_groups(self._groups):
                made = usp.init_sequence_parallel(sp, ulysses_degree=key[2], layout=layout, timeout=60)
            self._topos[key] = made
        return self._topos[key]


@contextlib.contextmanager
def _reused_groups(groups: dict):
    """``dist.new_group`` gives the group already made for the same ranks (the same on every rank:
    every rank makes the same calls in the same order)."""
    import torch.distributed as dist

    real = dist.new_group

    def new_group(ranks, **kwargs):
        key = tuple(ranks)
        if key not in groups:
            groups[key] = real(ranks, **kwargs)
        return groups[key]

    dist.new_group = new_group
    try:
        yield
    finally:
        dist.new_group = real


def _alive(topo) -> bool:
    """False once the process group the topology was built on is gone (a case destroyed it)."""
    from torch.distributed import distributed_c10d as c10d

    return all(g is None or g in c10d._world.pg_names for g in (topo.sp_group, topo.dp_group, topo.ulysses_group, topo.ring_group))


_ENVS: dict = {}
"""One Env per pool rank process, so its topologies serve every case run there."""


def run_case(rank: int, world: int, name: str):
    """Case ``name`` on this rank of a pool of ``world`` ranks (tests/conftest.py's ``ranks``)."""
    fn, worlds = CASES[name]
    if world not in worlds:
        raise KeyError(f"case {name} runs on {worlds} ranks, not {world}")
    env = _ENVS.get((rank, world)) or _ENVS.setdefault((rank, world), Env(rank, world))
    return fn(env)


def keep_backends(names) -> None:
    """Drop every registered backend but ``names`` (the library's: what a fresh interpreter has)."""
    from ulysses_sp import registry

    for name in set(registry._BACKENDS) - set(names):
        del registry._BACKENDS[name]


def library_backends_only(rank: int, world: int, names: tuple, fn, *args):
    """``fn(rank, world, *args)`` with the backend registry holding only ``names`` (the pool puts it back after)."""
    keep_backends(names)
    return fn(rank, world, *args)


def generator(name: str, offset: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(name.encode()) + offset)


def raised(fn, errors=(ValueError, TypeError)) -> str:
    """The message of the error (of ``errors``) ``fn`` raises, or 'NO ERROR'."""
    try:
        fn()
    except errors as e:
        return f"{type(e).__name__}: {e}"
    return "NO ERROR"


def max_err(a, b) -> float:
    return (a - b).abs().max().item()


def gather_all(tensors, topo, **kwargs) -> list:
    """``[usp.gather_sequence(t, topo, **kwargs) for t in tensors]`` (detached) in one all-gather of the
    tensors, ``[b, s, ...]`` alike in ``b`` and ``s``, side by side along their flattened trailing dims:
    here a collective costs each rank a millisecond or more of thread hand-offs, whatever its bytes."""
    b, s = tensors[0].shape[:2]
    whole = usp.gather_sequence(torch.cat([t.detach().reshape(b, s, -1) for t in tensors], dim=2), topo, **kwargs)
    parts = whole.split([t[0, 0].numel() for t in tensors], dim=2)
    return [part.reshape(*part.shape[:2], *t.shape[2:]).to(t.dtype) for part, t in zip(parts, tensors)]


def rel_rms(a, b) -> float:
    """||a - b|| / ||b||: over every element, so it does not hinge on one rounding as a max does."""
    return ((a - b).norm() / b.norm()).item()


# --------------------------------------------------------------------------- parity

@dataclasses.dataclass(frozen=True)
class Parity:
    layout: str = "zigzag"
    causal: bool = True
    hq: int = 12
    hkv: int = 4
    batch: int = 2
    seq: int = 48
    head_dim: int = 8
    grads: str = "qkv"
    cu_seqlens: tuple | None = None
    scale: float | None = None
    sp_size: int | None = None
    backend: str = "ulysses"
    claim_layout: str | None = None
    """Run with a topology that claims this layout (a deliberately wrong setup)."""
    dtype: torch.dtype = torch.float64
    strided: bool = False
    """Pass non-contiguous views (as Hugging Face's [B, H, S, D] transposed) instead of contiguous shards."""
    kernel: str = "auto"
    """``flash_attn`` runs on the CPU fake of flash-attn (``ulysses_sp.testing.fake_flash_attn``)."""
    window: int | None = None
    softcap: float | None = None
    topo_ulysses: int | None = None
    """The topology's ``ulysses_degree`` (None: 2 where the SP size is even, else 1)."""
    sinks: bool = False
    """Learned attention sinks (GPT-OSS), drawn away from 0 so a dropped or doubled sink shows."""
    profile: Profile | None = None
    """For ``auto`` (None: the built-in one)."""
    blocks: tuple | None = None
    """Bidirectional blocks (Gemma 3's images): global (start, end) runs that see each other's later tokens."""


BACKENDS = ("ulysses", "allgather", "ring", "hybrid")
HEADS = {"mha": (12, 12), "gqa": (12, 4), "mqa": (12, 1)}
"""12 q heads divide by 1..4 ranks, so Ulysses runs at P=3 too; 4 kv heads at P=3 cannot be
scattered or replicated, which is the case Ulysses refuses (tested in errors)."""
PARITY: dict[str, Parity] = {}
PARITY_WORLDS: dict[str, tuple] = {}


def _parity(name: str, cfg: Parity, worlds=WORLDS) -> None:
    PARITY[name], PARITY_WORLDS[name] = cfg, worlds


for _backend in BACKENDS:
    for _layout in layout.LAYOUTS:
        for _causal in (True, False):
            for _kind, (_hq, _hkv) in HEADS.items():
                _worlds = (1, 2, 4) if (_backend, _kind) == ("ulysses", "gqa") else WORLDS
                _cfg = Parity(_layout, _causal, _hq, _hkv, backend=_backend)
                _parity(f"{_backend}/{_layout}-{'causal' if _causal else 'full'}-{_kind}", _cfg, _worlds)
    for _grads in ("kv", "q", "v"):
        _parity(f"{_backend}/zigzag-causal-mqa-grad-{_grads}-only", Parity(hkv=1, grads=_grads, backend=_backend))
    _odd = Parity("contiguous", batch=3, hq=4, hkv=2, head_dim=40, scale=0.3, backend=_backend)
    _parity(f"{_backend}/contiguous-causal-odd-shapes", _odd, (1, 2, 4) if _backend in ("ulysses", "hybrid") else WORLDS)
    _parity(f"{_backend}/zigzag-causal-strided-views", Parity(hkv=1, strided=True, backend=_backend))
    _parity(f"{_backend}/zigzag-causal-bf16", Parity(hkv=1, dtype=torch.bfloat16, backend=_backend))
    _parity(f"{_backend}/contiguous-full-fp32", Parity("contiguous", causal=False, hkv=1, dtype=torch.float32, backend=_backend))
PACKINGS = {"packed": (0, 5, 13, 14, 48), "packed-short-docs": (0, 1, 2, 19, 20, 31, 47, 48)}
"""Documents shorter than a shard, spanning several ranks, and crossing zigzag chunks."""
for _backend in BACKENDS:
    for _layout in layout.LAYOUTS:
        for _causal in (True, False):
            for _pack, _cu in PACKINGS.items():
                _hkv = 4 if _backend in ("allgather", "ring") else 1
                _cfg = Parity(_layout, _causal, hkv=_hkv, cu_seqlens=_cu, backend=_backend)
                _parity(f"{_backend}/{_layout}-{'causal' if _causal else 'full'}-{_pack}", _cfg)
for _backend in BACKENDS:  # the flash_attn kernel (CPU fake) in bf16: GQA, both layouts, causal or not, packed
    _gqa_worlds = (1, 2, 4) if _backend == "ulysses" else WORLDS
    for _layout in layout.LAYOUTS:
        for _causal in (True, False):
            _cfg = Parity(_layout, _causal, dtype=torch.bfloat16, kernel="flash_attn", backend=_backend)
            _parity(f"{_backend}/{_layout}-{'causal' if _causal else 'full'}-gqa-flash_attn", _cfg, _gqa_worlds)
        _cfg = Parity(_layout, hkv=1, cu_seqlens=PACKINGS["packed-short-docs"], dtype=torch.bfloat16, kernel="flash_attn", backend=_backend)
        _parity(f"{_backend}/{_layout}-causal-packed-flash_attn", _cfg)
    _parity(f"{_backend}/zigzag-causal-d12-flash_attn", Parity(hkv=1, head_dim=12, dtype=torch.bfloat16, kernel="flash_attn", backend=_backend))
for _stride in (1, 3):  # 3 does not divide the 4 kv heads: a last chunk of 1 takes the rest
    _parity(f"allgather_stride{_stride}/zigzag-causal-gqa", Parity(hq=8, hkv=4, backend=f"allgather_stride{_stride}"))
_parity("auto/zigzag-causal-gqa", Parity(backend="auto"))
# the hybrid at a Ulysses degree other than the topology's (4): 6 q heads do not split over 4 ranks
_parity("hybrid-u2/zigzag-causal-gqa-topo-u4", Parity(hq=6, hkv=2, backend="hybrid-u2", topo_ulysses=4), (4,))
_parity("hybrid-u2/contiguous-full-packed-topo-u4", Parity("contiguous", False, hq=6, hkv=6, cu_seqlens=PACKINGS["packed"], backend="hybrid-u2", topo_ulysses=4), (4,))
_DEAR_RING = Profile(**{**CPU_GLOO_PROFILE.__dict__, "backend_overhead": {"ring": 1.0, "allgather": 1.0}, "backend_overhead_kv": None})
"""The ring and the all-gather charged a second per shard byte: the hybrid is the cheapest left."""
_parity("auto/zigzag-causal-2-heads-topo-u4", Parity(hq=2, hkv=2, backend="auto", topo_ulysses=4, profile=_DEAR_RING), (4,))
_parity("ulysses/zigzag-causal-dp2-sp2", Parity(hkv=1, sp_size=2), (4,))
_parity("ulysses/mislabelled-layout", Parity(hkv=1, claim_layout="contiguous"), (2, 3, 4))


WINDOW_BACKENDS = (*BACKENDS, "halo")
WINDOWS = (5, 13)
"""Shorter than a chunk (5 <= 48 / 8), and spanning chunks and ranks (13 > 12 = 48 / 4)."""
for _backend in WINDOW_BACKENDS:  # sliding windows: every backend, both layouts, packed or not
    _hq, _hkv = (12, 12) if _backend == "ulysses" else (12, 4)
    for _layout in layout.LAYOUTS:
        for _w in WINDOWS:
            for _pack, _cu in (("", None), ("-packed", PACKINGS["packed-short-docs"])):
                _parity(f"{_backend}/{_layout}-window{_w}{_pack}", Parity(_layout, hq=_hq, hkv=_hkv, cu_seqlens=_cu, window=_w, backend=_backend))
    _parity(f"{_backend}/zigzag-window1", Parity(hq=_hq, hkv=_hkv, window=1, backend=_backend))
    _parity(f"{_backend}/zigzag-window30-softcap", Parity(hq=_hq, hkv=_hkv, window=30, softcap=2.0, backend=_backend))
    if _backend != "halo":  # halo runs windowed layers only
        _parity(f"{_backend}/contiguous-softcap", Parity("contiguous", hq=_hq, hkv=_hkv, softcap=2.0, backend=_backend))
    _parity(f"{_backend}/zigzag-window13-packed-softcap-flash_attn", Parity(
        hq=_hq, hkv=_hkv, cu_seqlens=PACKINGS["packed"], window=13, softcap=2.0, dtype=torch.bfloat16, kernel="flash_attn", backend=_backend))
_parity("auto/zigzag-window5", Parity(window=5, backend="auto"))
for _backend in (*WINDOW_BACKENDS, "ulysses-g2"):  # learned sinks: once per row, whatever the blocks, hops or head groups
    _hq, _hkv = (24, 8) if _backend == "ulysses-g2" else (12, 12) if _backend == "ulysses" else (12, 4)
    _worlds = (1, 2, 4) if _backend == "ulysses-g2" else WORLDS
    if _backend != "halo":
        _parity(f"{_backend}/zigzag-causal-sinks", Parity(hq=_hq, hkv=_hkv, sinks=True, backend=_backend), _worlds)
        _parity(f"{_backend}/contiguous-causal-packed-sinks", Parity("contiguous", hq=_hq, hkv=_hkv, cu_seqlens=PACKINGS["packed"], sinks=True,
                                                                     backend=_backend), _worlds)
    _parity(f"{_backend}/balanced-window13-packed-sinks", Parity("balanced", hq=_hq, hkv=_hkv, cu_seqlens=PACKINGS["packed-short-docs"],
                                                                 window=13, sinks=True, backend=_backend), _worlds)
_parity("auto/zigzag-window5-sinks", Parity(window=5, sinks=True, backend="auto"))
_parity("ring/zigzag-causal-sinks-flash_attn", Parity(hq=12, hkv=4, sinks=True, dtype=torch.bfloat16, kernel="flash_attn", backend="ring"))
BLOCKS = {"": ((3, 20), (26, 27), (30, 45)), "-packed": ((1, 4), (6, 12), (20, 37), (40, 46))}
"""Bidirectional blocks across zigzag chunks and ranks at every P (chunks of 6 to 24 tokens), one of a single token;
packed: within the documents of PACKINGS["packed"]."""
for _backend in (*WINDOW_BACKENDS, "ulysses-g2"):  # bidirectional blocks: every backend and layout, packed or not, windows
    _hq, _hkv = (24, 8) if _backend == "ulysses-g2" else (12, 12) if _backend == "ulysses" else (12, 4)
    _worlds = (1, 2, 4) if _backend == "ulysses-g2" else WORLDS
    _full = 5 if _backend == "halo" else None  # halo runs windowed layers only
    for _layout in layout.LAYOUTS:
        _parity(f"{_backend}/{_layout}-blocks{'-window5' if _full else ''}", Parity(_layout, hq=_hq, hkv=_hkv, window=_full, blocks=BLOCKS[""],
                                                                                   backend=_backend), _worlds)
        _parity(f"{_backend}/{_layout}-blocks-window13-packed", Parity(_layout, hq=_hq, hkv=_hkv, window=13, cu_seqlens=PACKINGS["packed"],
                                                                       blocks=BLOCKS["-packed"], backend=_backend), _worlds)
    _parity(f"{_backend}/zigzag-blocks-window13-packed-softcap-sinks-flash_attn", Parity(
        hq=_hq, hkv=_hkv, cu_seqlens=PACKINGS["packed"], window=13, softcap=2.0, sinks=True, blocks=BLOCKS["-packed"], dtype=torch.bfloat16,
        kernel="flash_attn", backend=_backend), _worlds)
_parity("auto/zigzag-blocks-window5", Parity(window=5, blocks=BLOCKS[""], backend="auto"))
PIPELINED = ("ulysses-g2", "ulysses-g3")
"""Ulysses over head groups. 24 q heads leave every rank 2 or more groups at P = 1..4; a rank's
KV heads travel with the groups where they divide into them (GQA 24/8 at P=2, G=2) and whole with
the first group elsewhere (MQA, GQA at P=4)."""
for _backend in PIPELINED:
    for _kind, _hkv in (("mha", 24), ("gqa", 8), ("mqa", 1)):
        for _layout in layout.LAYOUTS:
            _parity(f"{_backend}/{_layout}-causal-{_kind}", Parity(_layout, hq=24, hkv=_hkv, backend=_backend), (1, 2, 4))
    for _grads in ("kv", "q", "v"):
        _parity(f"{_backend}/zigzag-causal-gqa-grad-{_grads}-only", Parity(hq=24, hkv=8, grads=_grads, backend=_backend), (1, 2, 4))
    _parity(f"{_backend}/contiguous-full-mha-packed", Parity("contiguous", False, hq=24, hkv=24, cu_seqlens=PACKINGS["packed-short-docs"],
                                                             backend=_backend))
    _parity(f"{_backend}/zigzag-causal-strided-views", Parity(hq=24, hkv=1, strided=True, backend=_backend))
    _parity(f"{_backend}/zigzag-causal-bf16", Parity(hq=24, hkv=8, dtype=torch.bfloat16, backend=_backend), (1, 2, 4))
    _parity(f"{_backend}/zigzag-window13-packed-softcap-flash_attn", Parity(
        hq=24, hkv=24, cu_seqlens=PACKINGS["packed"], window=13, softcap=2.0, dtype=torch.bfloat16, kernel="flash_attn", backend=_backend))


def _topo_for(env: Env, cfg: Parity, layout_: str):
    """Hybrid runs 2-D where it can (2 x 2 on 4 ranks); the other backends ignore the split."""
    sp = cfg.sp_size or env.world
    return env.topo(cfg.sp_size, layout_, cfg.topo_ulysses or (2 if sp % 2 == 0 else 1))


def parity(env: Env, name: str, cfg: Parity) -> dict:
    if cfg.kernel == "flash_attn":
        from ulysses_sp.testing.fake_flash_attn import install

        with install() as fake:
            result = _parity_run(env, name, cfg)
        result["flash_attn_calls"] = sum(fake.calls.values())
        return result
    return _parity_run(env, name, cfg)


def _parity_run(env: Env, name: str, cfg: Parity) -> dict:
    topo = _topo_for(env, cfg, cfg.layout)
    gen = generator(name, topo.dp_rank)  # each DP group gets its own data
    shape_q = (cfg.batch, cfg.seq, cfg.hq, cfg.head_dim)
    shape_kv = (cfg.batch, cfg.seq, cfg.hkv, cfg.head_dim)
    q, dout = (torch.randn(shape_q, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(shape_kv, generator=gen, dtype=torch.float64) for _ in range(2))

    sinks = (torch.randn(cfg.hq, generator=gen, dtype=torch.float64) + 1.0).requires_grad_() if cfg.sinks else None
    leaves = {n: t.clone().requires_grad_(n in cfg.grads) for n, t in zip("qkv", (q, k, v))}
    ref = reference_attention(*leaves.values(), causal=cfg.causal, scale=cfg.scale, cu_seqlens=cfg.cu_seqlens, window=cfg.window,
                              softcap=cfg.softcap or 0.0, sinks=sinks, blocks=cfg.blocks)
    ref.backward(dout)

    docs = cfg.cu_seqlens or (0, cfg.seq)  # the balanced layout places tokens by document

    def local(t):
        t = usp.shard_sequence(t, topo, cu_seqlens=docs).to(cfg.dtype)
        return t.transpose(1, 2).contiguous().transpose(1, 2) if cfg.strided else t

    shards = {n: local(t).requires_grad_(n in cfg.grads) for n, t in zip("qkv", (q, k, v))}
    run_topo = dataclasses.replace(topo, layout=cfg.claim_layout) if cfg.claim_layout else topo
    attn = usp.SequenceParallelAttention(run_topo, backend=cfg.backend, layer_idx=0, kernel=cfg.kernel, profile=cfg.profile)
    local_sinks = None if sinks is None else sinks.detach().clone().requires_grad_()  # a replicated parameter: the same on every rank
    out = attn(*shards.values(), causal=cfg.causal, softmax_scale=cfg.scale, cu_seqlens=cfg.cu_seqlens, window=cfg.window,
               softcap=cfg.softcap, sinks=local_sinks, blocks=cfg.blocks)
    (out * usp.shard_sequence(dout, topo, cu_seqlens=docs).to(cfg.dtype)).sum().backward()

    with torch.no_grad():
        grads = {n: shard.grad for n, shard in shards.items() if shard.grad is not None}
        whole = dict(zip(["out", *grads], (t.double() for t in gather_all([out, *grads.values()], topo, cu_seqlens=docs))))
        result = {"out": max_err(whole["out"], ref), "out_dtype": str(out.dtype)}
        result["out_scale"] = ref.abs().max().item()
        result["out_rms"] = rel_rms(whole["out"], ref)
        for n, shard in shards.items():
            got = shard.grad
            result[f"d{n}"] = None if got is None else max_err(whole[n], leaves[n].grad)
            if got is not None:  # window 1: dq is 0 in exact arithmetic, and then the norm of ours is the error
                result[f"d{n}_rms"] = rel_rms(whole[n], leaves[n].grad) if leaves[n].grad.norm() > 0 else whole[n].norm().item()
            result[f"d{n}_is_none"] = got is None
            result[f"d{n}_dtype"] = None if got is None else str(got.dtype)
            result[f"d{n}_scale"] = None if got is None else leaves[n].grad.abs().max().item()
        if sinks is not None:  # each rank's rows (or heads) give their part of the replicated sinks' gradient
            summed = local_sinks.grad.double()
            if topo.sp_size > 1:
                dist.all_reduce(summed, group=topo.sp_group)
            result.update(dsinks=max_err(summed, sinks.grad), dsinks_scale=sinks.grad.abs().max().item(), dsinks_rms=rel_rms(summed, sinks.grad))
    result["chosen"] = [b.name for b in attn._chosen.values()]
    if cfg.backend == "auto":
        _, considered = choose_backend(usp.attention.make_spec(*shards.values(), topo, sinks=local_sinks, blocks=cfg.blocks), topo, cfg.profile)
        result["considered"] = {n: e.seconds if isinstance(e, Estimate) else e for n, e in considered.items()}
    return result


for _name, _cfg in PARITY.items():
    case(f"parity/{_name}", PARITY_WORLDS[_name])(lambda env, n=_name, c=_cfg: parity(env, n, c))


# --------------------------------------------------------------------------- bytes

BYTES = {  # name: (q heads, kv heads, inputs that need a gradient)
    "mha": (12, 12, "qkv"), "gqa": (12, 4, "qkv"), "mqa": (12, 1, "qkv"), "mqa-frozen-kv": (12, 1, "q"), "mqa-frozen-q": (12, 1, "kv"),
}
BYTES_SHAPE = (2, 48, 8)  # batch, global tokens, head dim; float32


def backend_bytes(env: Env, backend: str, hq: int, hkv: int, grads: str) -> dict:
    b, s, d = BYTES_SHAPE
    topo = _topo_for(env, Parity(), "zigzag")
    if usp.get_backend(backend).check(usp.attention.make_spec(*(torch.empty(b, s // env.world, h, d) for h in (hq, hkv, hkv)), topo), topo):
        return None
    gen = generator("bytes")
    full = [torch.randn(b, s, h, d, generator=gen) for h in (hq, hkv, hkv)]
    shards = [usp.shard_sequence(t, topo).requires_grad_(n in grads) for n, t in zip("qkv", full)]
    fwd, bwd, estimate = _counted(topo, backend, shards)
    return {
        "fwd": (fwd.bytes_sent, fwd.bytes_recv, {o: dataclasses.astuple(c) for o, c in fwd.by_op.items()}),
        "bwd": (bwd.bytes_sent, bwd.bytes_recv, {o: dataclasses.astuple(c) for o, c in bwd.by_op.items()}),
        "estimate": estimate,
        "degrees": (topo.ulysses_degree, topo.ring_degree),
    }


def _counted(topo, backend: str, shards, **options):
    """(forward CommCounter, backward CommCounter, ``estimate()``'s forward and backward bytes)
    of one attention call after a first one (which does the one-off cross-rank shape handshake)."""
    attn = usp.SequenceParallelAttention(topo, backend=backend)
    attn(*shards, **options)
    with usp.CommCounter() as fwd:
        out = attn(*shards, **options)
    with usp.CommCounter() as bwd:
        out.sum().backward()
    spec = usp.attention.make_spec(*shards, topo, **options)
    estimate = usp.get_backend(backend).estimate(spec, topo, usp.CPU_GLOO_PROFILE)
    return fwd, bwd, (estimate.comm_bytes, estimate.bwd_comm_bytes)


for _backend in (*BACKENDS, "ulysses-g2"):
    for _name, _args in BYTES.items():
        case(f"bytes/{_backend}/{_name}", WORLDS)(lambda env, be=_backend, a=_args: backend_bytes(env, be, *a))


def halo_bytes(env: Env, lay: str, window: int, blocks=None) -> dict:
    """Bytes of a windowed layer (with bidirectional ``blocks``) per rank, forward and backward, for every backend that runs it."""
    topo = env.topo(None, lay, 2 if env.world % 2 == 0 else 1)
    b, s, d = BYTES_SHAPE
    gen = generator("halo-bytes")
    full = [torch.randn(b, s, h, d, generator=gen) for h in (12, 4, 4)]
    shards = [usp.shard_sequence(t, topo, cu_seqlens=(0, s)).requires_grad_() for t in full]
    result = {}
    for backend in ("halo", "ring", "allgather", "hybrid"):
        fwd, bwd, estimate = _counted(topo, backend, shards, window=window, blocks=blocks)
        result[backend] = {"fwd": (fwd.bytes_sent, fwd.bytes_recv), "bwd": (bwd.bytes_sent, bwd.bytes_recv), "estimate": estimate}
    return result


@case("bytes/sinks", WORLDS)
def sinks_bytes(env: Env) -> dict:
    """Learned sinks move nothing: each backend's bytes forward and backward with and without them."""
    topo = env.topo(None, "zigzag", 2 if env.world % 2 == 0 else 1)
    b, s, d = BYTES_SHAPE
    gen = generator("sinks-bytes")
    full = [torch.randn(b, s, 12, d, generator=gen) for _ in range(3)]
    shards = [usp.shard_sequence(t, topo).requires_grad_() for t in full]
    sinks = torch.randn(12, generator=gen).requires_grad_()
    result = {}
    for backend, window in (("ulysses", None), ("ulysses-g2", None), ("allgather", None), ("ring", None), ("hybrid", None), ("halo", 5)):
        counted = [_counted(topo, backend, shards, window=window, **extra) for extra in ({}, {"sinks": sinks})]
        result[backend] = [(fwd.bytes_sent, fwd.bytes_recv, bwd.bytes_sent, bwd.bytes_recv, estimate) for fwd, bwd, estimate in counted]
    return result


def planted_sink_per_ring_block(env: Env) -> dict:
    """Control: the ring folding a sink (of logit 0) into every hop's partial result besides the one
    per row. The parity case with sinks must see it (``blocks_forward`` of ring_pass wrapped for the call)."""
    from ulysses_sp import ring_pass
    from ulysses_sp.kernels import add_sink

    honest = ring_pass.blocks_forward

    def per_block(kernel, q, k, v, calls, spec, out_acc, lse_acc, first=None):
        honest(kernel, q, k, v, calls, spec, out_acc, lse_acc, first)
        out_acc[:], lse_acc[:] = add_sink(out_acc, lse_acc, lse_acc.new_zeros(out_acc.shape[2]))

    ring_pass.blocks_forward = per_block
    try:
        return parity(env, "ring/zigzag-causal-sinks", PARITY["ring/zigzag-causal-sinks"])
    finally:
        ring_pass.blocks_forward = honest


case("parity-planted/sink-per-ring-block", (2, 4))(planted_sink_per_ring_block)


def planted_blocks_lost_across_ring_steps(env: Env, name: str) -> dict:
    """Control: the ring planning its calls against another rank's keys without the blocks (a block
    id lost across a ring step, as if each rank had its shard's blocks only). The blocks' parity case must see it."""
    from ulysses_sp import ring_pass

    honest = ring_pass.cached_plan

    def own_blocks_only(topo, q_segments, k_segments, spec, device):
        return honest(topo, q_segments, k_segments, spec if tuple(q_segments) == tuple(k_segments) else dataclasses.replace(spec, blocks=None),
                      device)

    ring_pass.cached_plan = own_blocks_only
    try:
        return parity(env, name, PARITY[name])
    finally:
        ring_pass.cached_plan = honest


for _name in ("ring/zigzag-blocks", "ring/zigzag-blocks-window13-packed"):
    case(f"parity-planted/blocks-lost-{_name}", (2, 3, 4))(lambda env, n=_name: planted_blocks_lost_across_ring_steps(env, n))


HALO_WINDOWS = (1, 5, 13, 40)
for _layout in layout.LAYOUTS:
    for _w in HALO_WINDOWS:
        case(f"bytes/windowed/{_layout}-{_w}", WORLDS)(lambda env, lay=_layout, w=_w: halo_bytes(env, lay, w))
    for _w in (5, 13):
        case(f"bytes/windowed/{_layout}-{_w}-blocks", WORLDS)(lambda env, lay=_layout, w=_w: halo_bytes(env, lay, w, BLOCKS[""]))


@functools.lru_cache(maxsize=None)
def _kernel_calls_inputs(docs):
    """(cu_seqlens, q k v) for kernel_calls: the same for every backend and layout."""
    cu = docs and (0, *(round(i * 2009 / docs) + 7 for i in range(1, docs)), 2016)  # documents cross chunk boundaries
    gen = generator(f"calls-{docs}")
    return cu, [torch.randn(1, 2016, h, 8, generator=gen, dtype=torch.bfloat16) for h in (12, 1, 1)]


@functools.lru_cache(maxsize=None)
def _kernel_calls_reference(docs):
    cu, full = _kernel_calls_inputs(docs)
    return reference_attention(*(t.double() for t in full), causal=True, cu_seqlens=cu)


def kernel_calls(env: Env, backend: str, lay: str = "zigzag") -> dict:
    """flash-attn forward calls (CPU fake) per attention forward on 2016 tokens, unpacked (None)
    or packed in 24 or 1000 documents: the block plans make one varlen call per chunk pair. The
    gathered output, the same on every rank, is compared with the fp64 reference on rank 0 only
    (each rank computing it took a second of the case's CPU)."""
    from ulysses_sp.testing.fake_flash_attn import install

    topo = _topo_for(env, Parity(), lay)
    counts = {}
    for docs in (None, 24, 1000):
        cu, full = _kernel_calls_inputs(docs)
        shards = [usp.shard_sequence(t, topo, cu_seqlens=cu or (0, 2016)) for t in full]
        with install() as fake:  # the first call: its handshake and block plans call no kernel (the second call's count is the same)
            out = usp.sp_attention(*shards, topo, backend=backend, kernel="flash_attn", cu_seqlens=cu)
            counts[docs] = {"calls": fake.calls["_flash_attn_forward"] + fake.calls["_flash_attn_varlen_forward"],
                            "varlen": fake.calls["_flash_attn_varlen_forward"]}
        whole = usp.gather_sequence(out, topo, cu_seqlens=cu or (0, 2016))
        counts[docs]["err"] = max_err(whole.double(), _kernel_calls_reference(docs)) if env.rank == 0 else None
    return counts


for _backend in BACKENDS:
    case(f"kernel-calls/{_backend}", (2, 3, 4))(lambda env, be=_backend: kernel_calls(env, be))
    case(f"kernel-calls-balanced/{_backend}", (2, 3, 4))(lambda env, be=_backend: kernel_calls(env, be, "balanced"))


@case("agree/all-backends", (2, 3, 4))
def all_backends_agree(env: Env) -> dict:
    """Every backend on the same shards against the fp64 reference: out and every gradient."""
    topo = _topo_for(env, Parity(), "zigzag")
    hkv = 3 if env.world == 3 else 4
    gen = generator("agree")
    full = [torch.randn(2, 48, h, 8, generator=gen, dtype=torch.float64) for h in (12, hkv, hkv)]
    dout_full = torch.randn(2, 48, 12, 8, generator=gen, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in full]
    ref_out = reference_attention(*leaves)
    ref_out.backward(dout_full)
    ref = [ref_out.detach()] + [t.grad for t in leaves]
    dout = usp.shard_sequence(dout_full, topo)
    results = {}
    for backend in BACKENDS:
        shards = [usp.shard_sequence(t, topo).requires_grad_() for t in full]
        out = usp.sp_attention(*shards, topo, backend=backend)
        (out * dout).sum().backward()
        results[backend] = gather_all([out] + [t.grad for t in shards], topo)
    return {be: max(max_err(a, b) for a, b in zip(got, ref)) for be, got in results.items()}


def low_precision_error(env: Env, dtype: torch.dtype) -> dict:
    """Relative RMS error against fp64 attention of the same (rounded) inputs, per backend: [out, dq, dk, dv]."""
    topo = _topo_for(env, Parity(), "zigzag")
    gen = generator(str(dtype))
    full = [torch.randn(2, 48, h, 16, generator=gen).to(dtype).double() for h in (12, 4, 4)]
    dout = torch.randn(2, 48, 12, 16, generator=gen).to(dtype).double()
    leaves = [t.clone().requires_grad_() for t in full]
    reference_attention(*leaves).backward(dout)
    errors = {}
    for backend in BACKENDS:
        shards = [usp.shard_sequence(t, topo).to(dtype).requires_grad_() for t in full]
        out = usp.sp_attention(*shards, topo, backend=backend)
        (out * usp.shard_sequence(dout, topo).to(dtype)).sum().backward()
        with torch.no_grad():
            got = [out] + [t.grad for t in shards]
            want = [reference_attention(*full)] + [t.grad for t in leaves]
            errors[backend] = [rel_rms(g.double(), w) for g, w in zip(gather_all(got, topo), want)]
    return errors


for _name, _dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
    case(f"numerics/{_name}", (1, 2, 4))(lambda env, d=_dtype: low_precision_error(env, d))


@case("numerics/autocast", (1, 2, 4))
def autocast_inputs(env: Env) -> dict:
    """What a model under CPU bf16 autocast hands attention: q and k in fp32 (RoPE upcasts them), v in
    bf16. Per backend: the output's dtype, each gradient's dtype, and [out, dq, dk, dv] relative RMS
    error against fp64 attention of the bf16-rounded inputs; and SDPA's under the same autocast."""
    topo = _topo_for(env, Parity(), "zigzag")
    gen = generator("autocast")
    full = [torch.randn(2, 48, h, 16, generator=gen).to(torch.bfloat16).double() for h in (12, 4, 4)]
    dout = torch.randn(2, 48, 12, 16, generator=gen).to(torch.bfloat16).double()
    leaves = [t.clone().requires_grad_() for t in full]
    want_out = reference_attention(*leaves)
    want_out.backward(dout)
    want = [want_out.detach()] + [t.grad for t in leaves]
    dtypes = (torch.float32, torch.float32, torch.bfloat16)
    sdpa = [t.to(d).transpose(1, 2).requires_grad_() for t, d in zip(full, dtypes)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.nn.functional.scaled_dot_product_attention(*sdpa, is_causal=True, enable_gqa=True)
    out.backward(dout.transpose(1, 2).to(out.dtype))
    got = [out.transpose(1, 2)] + [t.grad.transpose(1, 2) for t in sdpa]
    result = {"sdpa": {"dtypes": [str(t.dtype) for t in got], "errors": [rel_rms(g.double(), w) for g, w in zip(got, want)]}}
    for backend in BACKENDS:
        shards = [usp.shard_sequence(t, topo).to(d).requires_grad_() for t, d in zip(full, dtypes)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = usp.sp_attention(*shards, topo, backend=backend)
        (out * usp.shard_sequence(dout, topo).to(out.dtype)).sum().backward()
        with torch.no_grad():
            got = [out] + [t.grad for t in shards]
            result[backend] = {"dtypes": [str(t.dtype) for t in got],
                               "errors": [rel_rms(g.double(), w) for g, w in zip(gather_all([t.double() for t in got], topo), want)]}
    return result


# --------------------------------------------------------------------------- comm primitives

def _rank_tensor(name, rank, shape):
    return torch.randn(shape, generator=generator(name, rank), dtype=torch.float64)


@case("comm/all_to_all")
def comm_all_to_all(env: Env) -> dict:
    topo, p = env.topo(), env.world
    shape = (2 * p, 3, 4 * p)
    x = _rank_tensor("a2a", env.rank, shape).requires_grad_()
    with usp.CommCounter() as c:
        y = comm.all_to_all(x, topo.sp_group, scatter_dim=2, gather_dim=0)
    everyone = [_rank_tensor("a2a", r, shape) for r in range(p)]
    expected = torch.cat([t.chunk(p, dim=2)[env.rank] for t in everyone], dim=0)
    w = _rank_tensor("a2a-w", env.rank, y.shape)
    (y * w).sum().backward()
    # d/dx_r of sum_j <y_j, w_j>: the part of w_j that came from x_r, sent back.
    all_w = [_rank_tensor("a2a-w", r, y.shape) for r in range(p)]
    grad_expected = torch.cat([wj.chunk(p, dim=0)[env.rank] for wj in all_w], dim=2)
    return {
        "err": max_err(y, expected),
        "grad_err": max_err(x.grad, grad_expected),
        "sent": c.bytes_sent,
        "expected_sent": x.numel() * 8 * (p - 1) // p,
    }


@case("comm/all_gather_reduce_scatter")
def comm_gather_scatter(env: Env) -> dict:
    topo, p, r = env.topo(), env.world, env.rank
    x = _rank_tensor("ag", r, (2, 3, 5)).requires_grad_()
    with usp.CommCounter() as c_ag:
        y = comm.all_gather(x, topo.sp_group, dim=1)
    everyone = [_rank_tensor("ag", i, (2, 3, 5)) for i in range(p)]
    w = _rank_tensor("ag-w", r, y.shape)
    with usp.CommCounter() as c_bwd:
        (y * w).sum().backward()
    # Backward sums every rank's gradient for this rank's slice.
    all_w = [_rank_tensor("ag-w", i, y.shape) for i in range(p)]
    grad_expected = sum(wi.chunk(p, dim=1)[r] for wi in all_w)

    z_in = _rank_tensor("rs", r, (2, 4 * p, 3))
    with usp.CommCounter() as c_rs:
        z = comm.reduce_scatter(z_in, topo.sp_group, dim=1)
    z_expected = sum(_rank_tensor("rs", i, (2, 4 * p, 3)) for i in range(p)).chunk(p, dim=1)[r]

    shapes = {"a": ((2, 3), torch.float64), "b": ((5,), torch.float32), "c": ((1, 1), torch.float64)}
    mine = [_rank_tensor(f"sums-{n}", r, shape).to(dtype) for n, (shape, dtype) in shapes.items()]
    with usp.CommCounter() as c_sums:
        sums = comm.all_reduce_sums(mine, topo.sp_group)
    sums_expected = [sum(_rank_tensor(f"sums-{n}", i, shape).to(dtype) for i in range(p)) for n, (shape, dtype) in shapes.items()]
    return {
        "sums": [(tuple(s.shape), s.dtype, max_err(s.double(), e.double())) for s, e in zip(sums, sums_expected)],
        "sums_expected": [(shape, dtype, 0.0) for shape, dtype in shapes.values()],
        "sums_counted": (c_sums.by_op["all_reduce"].calls, c_sums.bytes_sent),
        "sums_bytes": (p - 1) * sum(t.numel() * t.element_size() for t in mine),
        "gather_err": max_err(y, torch.cat(everyone, dim=1)),
        "gather_grad_err": max_err(x.grad, grad_expected),
        "scatter_err": max_err(z, z_expected),
        "ag_sent": c_ag.by_op["all_gather"].sent if p > 1 else 0,
        "ag_expected": x.numel() * 8 * (p - 1),
        "bwd_rs_sent": c_bwd.bytes_sent,
        "rs_sent": c_rs.bytes_sent,
        "rs_expected": z_in.numel() * 8 * (p - 1) // p,
    }


@case("comm/rows_to_ranks", worlds=(2, 3, 4))
def comm_rows_to_ranks(env: Env) -> dict:
    """Rank i sends i + j rows of width 3 to rank j (none from rank 0 to itself); forward, backward, bytes."""
    topo, p, r = env.topo(), env.world, env.rank
    send = [r + j for j in range(p)]
    x = _rank_tensor("rows", r, (sum(send), 3)).requires_grad_()
    with usp.CommCounter() as c:
        y = comm.rows_to_ranks(x, send, [i + r for i in range(p)], topo.sp_group)
    expected = torch.cat([_rank_tensor("rows", i, (sum(i + j for j in range(p)), 3)).split([i + j for j in range(p)])[r] for i in range(p)])
    with usp.CommCounter() as back:
        (y * _rank_tensor("rows-w", r, y.shape)).sum().backward()
    weights = [_rank_tensor("rows-w", j, (sum(i + j for i in range(p)), 3)).split([i + j for i in range(p)]) for j in range(p)]
    return {
        "err": max_err(y, expected),
        "grad_err": max_err(x.grad, torch.cat([weights[j][r] for j in range(p)])),
        "bytes": (c.by_op["all_to_all_rows"].sent, c.by_op["all_to_all_rows"].recv, back.bytes_sent, back.bytes_recv),
        "expected": ((sum(send) - 2 * r) * 24, (sum(i + r for i in range(p)) - 2 * r) * 24),
    }


@case("comm/ring_send_recv", worlds=(2, 3, 4))
def comm_ring(env: Env) -> dict:
    topo, p, r = env.topo(), env.world, env.rank
    xs = [_rank_tensor("ring", r, (3, 4)), _rank_tensor("ring2", r, (5,))]
    with usp.CommCounter() as c:
        got, wait = comm.ring_send_recv(xs, topo.sp_group, send_to=(r + 1) % p, recv_from=(r - 1) % p)
        wait()
    prev = (r - 1) % p
    return {
        "err": max(max_err(got[0], _rank_tensor("ring", prev, (3, 4))), max_err(got[1], _rank_tensor("ring2", prev, (5,)))),
        "sent": c.bytes_sent,
        "recv": c.bytes_recv,
        "expected": (12 + 5) * 8,
    }


@case("comm/seq_heads_roundtrip")
def comm_seq_heads(env: Env) -> dict:
    """seq_to_heads of several tensors at once equals the head slices of the full
    tensors in global order, for both layouts; heads_to_seq inverts it."""
    p, errs = env.world, {}
    for lay in layout.LAYOUTS:
        topo = env.topo(layout=lay)
        gen = generator("s2h-" + lay)
        full = [torch.randn(2, 8 * p, h, 3, generator=gen, dtype=torch.float64) for h in (2 * p, p, 3 * p)]
        shards = [usp.shard_sequence(t, topo, cu_seqlens=(0, 8 * p)) for t in full]
        table = layout.chunk_table(lay, p, 8 * p)
        with usp.CommCounter() as c:
            heads = comm.seq_to_heads(shards, topo.sp_group, table)
        h_err = max(max_err(hd, t.chunk(p, dim=2)[env.rank]) for hd, t in zip(heads, full))
        back = comm.heads_to_seq(heads, topo.sp_group, table)
        errs[lay] = {
            "heads_err": h_err,
            "back_err": max(max_err(b, s) for b, s in zip(back, shards)),
            "calls": c.by_op["all_to_all"].calls if p > 1 else 1,
        }
    return errs


@case("data/shard_gather")
def data_shard_gather(env: Env) -> dict:
    p, r, out = env.world, env.rank, {}
    for lay in layout.LAYOUTS:
        topo = env.topo(layout=lay)
        x = torch.randn(3, 4 * p, 5, generator=generator("sg"), dtype=torch.float64)
        local = usp.shard_sequence(x, topo, cu_seqlens=(0, 4 * p)).requires_grad_()
        positions = layout.positions(lay, 4 * p, p, r, (0, 4 * p))
        full = usp.gather_sequence(local, topo, cu_seqlens=(0, 4 * p))
        w = torch.randn(full.shape, generator=generator("sg-w"), dtype=torch.float64)  # same on every rank
        (full * w).sum().backward()
        out[lay] = {
            "shard_err": max_err(local, x[:, positions]),
            "roundtrip_err": max_err(full, x),
            "grad_err": max_err(local.grad, p * w[:, positions]),
            "dim0_err": max_err(usp.gather_sequence(usp.shard_sequence(x.transpose(0, 1), topo, dim=0, cu_seqlens=(0, 4 * p)), topo, dim=0, cu_seqlens=(0, 4 * p)), x.transpose(0, 1)),
        }
    return out


# --------------------------------------------------------------------------- data side

def _one_process_loss(model, batch):
    """The reference: the whole sequence in one process, plain attention, mean over valid targets."""
    position_ids = batch.get("position_ids")
    cu = None
    if position_ids is not None:
        cu = tuple(usp.cu_seqlens_from_position_ids(position_ids).tolist())
    else:
        position_ids = torch.arange(batch["input_ids"].shape[1]).unsqueeze(0)
    logits = model(batch["input_ids"], position_ids, lambda q, k, v: reference_attention(q, k, v, causal=True, cu_seqlens=cu))
    labels = batch["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


TINY_BATCHES = ("padded", "packed", "mostly-padding")


def tiny_model(env: Env, backend: str, kind: str) -> dict:
    """Loss and every parameter gradient of a tiny LM with SP equal the one-process ones."""
    topo = _topo_for(env, Parity(), "zigzag")
    batch = make_batch(kind)
    ref_model = TinyLM()
    ref_loss = _one_process_loss(ref_model, batch)
    ref_loss.backward()

    model = TinyLM()
    local = usp.shard_batch(batch, topo)
    attn = usp.SequenceParallelAttention(topo, backend=backend, layer_idx=0)
    logits = model(local["input_ids"], local["position_ids"], lambda q, k, v: attn(q, k, v, cu_seqlens=local.get("cu_seqlens")))
    loss = usp.sp_cross_entropy(logits, local["shift_labels"], topo)
    loss.backward()
    summed = usp.comm.all_reduce_sums([p.grad for p in model.parameters()], topo.sp_group)  # the SP group's gradient is the sum of its ranks'
    grad_err = max(max_err(grad, p_ref.grad) for grad, p_ref in zip(summed, ref_model.parameters()))
    valid_here = int((local["shift_labels"] != -100).sum())
    return {"loss_err": abs(loss.item() - ref_loss.item()), "grad_err": grad_err, "loss": loss.item(), "valid_here": valid_here}


for _backend in BACKENDS:
    for _kind in TINY_BATCHES:
        case(f"model/{_backend}/{_kind}", (1, 2, 4))(lambda env, be=_backend, k=_kind: tiny_model(env, be, k))


@case("data/shard_batch")
def data_shard_batch(env: Env) -> dict:
    """Round trip through shard_batch + gather_sequence, and the number of valid targets."""
    out = {}
    for lay in layout.LAYOUTS:
        topo = env.topo(layout=lay)
        for kind in TINY_BATCHES:
            batch = make_batch(kind)
            local = usp.shard_batch(batch, topo)
            full = {k: usp.gather_sequence(v, topo, cu_seqlens=local.get("cu_seqlens")) for k, v in local.items() if k != "cu_seqlens"}
            s = batch["input_ids"].shape[1]
            valid_total = int(comm.all_reduce_sum((local["shift_labels"] != -100).sum(), topo.sp_group))
            out[(lay, kind)] = {
                "ids_roundtrip": bool(torch.equal(full["input_ids"][:, :s], batch["input_ids"])),
                "padded_len": full["input_ids"].shape[1],
                "positions": full["position_ids"][0].tolist(),
                "valid_targets_sp": valid_total,
                "valid_targets_one_process": int((batch["labels"][:, 1:] != -100).sum()),
                "cu_seqlens": None if "cu_seqlens" not in local else local["cu_seqlens"].tolist(),
            }
    return out


@case("data/public-helpers", (2, 3))
def data_public_helpers(env: Env) -> dict:
    """model_inputs on packed and unpacked shards; target_counts of two micro-batches over the
    group; CommCounter nesting (an inner counter sees only its calls, the outer one all)."""
    topo = env.topo()
    packed, plain = make_batch("packed"), make_batch("padded")
    local_packed, local_plain = usp.shard_batch(packed, topo), usp.shard_batch(plain, topo)
    inputs_packed, inputs_plain = usp.model_inputs(local_packed), usp.model_inputs(local_plain)
    counts = usp.target_counts([local_packed, local_plain], topo.sp_group, torch.device("cpu"))
    x = torch.ones(3)
    with usp.CommCounter() as outer:
        comm.all_gather(x, topo.sp_group)
        with usp.CommCounter() as inner:
            comm.all_gather(x, topo.sp_group)
            comm.all_reduce_sum(x, topo.sp_group)
    return {
        "packed keys": sorted(inputs_packed),
        "plain keys": sorted(inputs_plain),
        "same tensors": all(inputs_packed[k] is local_packed[k] for k in ("input_ids", "position_ids"))
        and inputs_packed["cu_seq_lens_q"] is local_packed["cu_seqlens"],
        "counts": counts.tolist(),
        "counts one process": [int((b["labels"][:, 1:] != -100).sum()) for b in (packed, plain)],
        "counts dtype": str(counts.dtype),
        "outer": {op: (c.calls, c.sent) for op, c in outer.by_op.items()},
        "inner": {op: (c.calls, c.sent) for op, c in inner.by_op.items()},
    }


@case("data/sampler", (4,))
def data_sampler(env: Env) -> dict:
    """Indices each rank draws for SP=2 x DP=2 and SP=4, two epochs, 11 samples (uneven over 2 DP groups)."""
    out = {}
    for sp in (2, 4):
        topo = env.topo(sp, "zigzag")
        for drop_last in (False, True):
            sampler = usp.SequenceParallelSampler(range(11), topo, shuffle=True, seed=3, drop_last=drop_last)
            epochs = []
            for epoch in (0, 1):
                sampler.set_epoch(epoch)
                epochs.append(list(sampler))
            out[(sp, drop_last)] = {"dp_rank": topo.dp_rank, "sp_rank": topo.sp_rank, "epochs": epochs}
    return out


# --------------------------------------------------------------------------- Hugging Face transformers

def _hf_case(env: Env, name: str) -> dict:
    from .hf_cases import HF_CASES, hf_parity

    return hf_parity(_topo_for(env, Parity(), "zigzag"), **HF_CASES[name])


if importlib.util.find_spec("transformers") is not None:  # else tests/test_transformers.py says it is missing
    from .hf_cases import HF_CASES, hf_errors

    for _name in HF_CASES:
        case(f"hf/{_name}", (2, 4))(lambda env, n=_name: _hf_case(env, n))
    case("hf/errors", (2, 4))(lambda env: hf_errors(_topo_for(env, Parity(), "zigzag")))

from . import coverage_cases  # noqa: E402  (multi-head latent attention; with transformers: families, coverage, verify)

coverage_cases.register(case, lambda env, lay="zigzag": _topo_for(env, Parity(), lay), importlib.util.find_spec("transformers") is not None)


# --------------------------------------------------------------------------- the auto policy

@case("policy/per-layer", (4,))
def per_layer_backends(env: Env) -> dict:
    """Two layers of one forward pass, 8 and 6 q heads on 4 ranks, one token layout:
    with all-to-all made cheap, auto picks Ulysses for the first and something else
    for the second (6 heads do not split over 4 ranks); both match the reference."""
    from ulysses_sp.profile import COLLECTIVES, LinkCost

    cheap = {c: LinkCost(1e-9, 1e15) if c == "all_to_all" else LinkCost(1.0, 1e3) for c in COLLECTIVES}
    profile = Profile(**{**CPU_GLOO_PROFILE.__dict__, "collectives": cheap})
    topo = _topo_for(env, Parity(), "zigzag")
    out = {}
    for layer, hq in enumerate((8, 6)):
        gen = generator(f"per-layer-{layer}")
        full = [torch.randn(1, 48, h, 8, generator=gen, dtype=torch.float64) for h in (hq, 2, 2)]
        attn = usp.SequenceParallelAttention(topo, backend="auto", layer_idx=layer, profile=profile)
        got = usp.gather_sequence(attn(*(usp.shard_sequence(t, topo) for t in full)), topo)
        out[layer] = {"chosen": [b.name for b in attn._chosen.values()], "err": max_err(got, reference_attention(*full))}
    return out


# --------------------------------------------------------------------------- DeepSpeed

def _ds(env: Env, what: str):
    from . import ds_cases

    topo = _topo_for(env, Parity(sp_size=2), "zigzag")
    if what == "gradients":
        return {f"{stage}-{rs}": ds_cases.ds_gradients(topo, stage, rs) for stage, rs in ds_cases.STAGES}
    return getattr(ds_cases, what)(topo)


if importlib.util.find_spec("deepspeed") is not None:  # else tests/test_deepspeed.py says it is missing
    for _what in ("gradients", "distributed_attention"):
        case(f"deepspeed/{_what}", (2, 4))(lambda env, w=_what: _ds(env, w))


# --------------------------------------------------------------------------- topology

@case("topology/groups")
def topology_groups(env: Env) -> dict:
    import torch.distributed as dist

    shapes = {}
    for sp in [d for d in (1, 2, 4) if env.world % d == 0]:
        for ud in [d for d in (1, 2, 4) if sp % d == 0]:
            t = usp.init_sequence_parallel(sp, ulysses_degree=ud, layout="contiguous", timeout=30)
            shapes[(sp, ud)] = {
                "sp": dist.get_process_group_ranks(t.sp_group),
                "dp": dist.get_process_group_ranks(t.dp_group),
                "ulysses": dist.get_process_group_ranks(t.ulysses_group),
                "ring": dist.get_process_group_ranks(t.ring_group),
                "ranks": (t.sp_rank, t.sp_size, t.dp_rank, t.dp_size, t.ulysses_rank, t.ulysses_degree, t.ring_rank, t.ring_degree),
                "hybrid": {u: {"ulysses": dist.get_process_group_ranks(g.ulysses_group), "ring": dist.get_process_group_ranks(g.ring_group),
                               "ranks": (g.ulysses_rank, g.ulysses_degree, g.ring_rank, g.ring_degree)}
                           for u in range(1, sp + 1) if sp % u == 0 and (u == ud or 1 < u < sp) for g in [t.hybrid_groups(u)]},
                "device": str(t.device),
                "timeout": t.timeout.total_seconds(),
            }
    return shapes


@case("topology/hybrid-degrees", (4,))
def hybrid_degrees(env: Env) -> dict:
    """The groups each init creates on 4 ranks (``new_group`` calls), which groups
    ``hybrid-u2`` runs on, and its output, with the topology's degree 2 and 4."""
    import torch.distributed as dist

    real, made = dist.new_group, []

    def counting(ranks, **kwargs):
        made.append(list(ranks))
        return real(ranks, **kwargs)

    gen = generator("hybrid-degrees")
    full = [torch.randn(1, 48, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3)]
    result, outs = {}, {}
    for ud in (2, 4):
        made.clear()
        dist.new_group = counting
        try:
            topo = usp.init_sequence_parallel(4, ulysses_degree=ud, timeout=60)
        finally:
            dist.new_group = real
        split = topo.hybrid_groups(2)
        result[ud] = {
            "new_groups": list(made),
            "own_groups": split.ulysses_group is topo.ulysses_group and split.ring_group is topo.ring_group,
            "shared": {"ulysses is sp": topo.ulysses_group is topo.sp_group, "ring is dp": topo.ring_group is topo.dp_group},
            "ulysses": dist.get_process_group_ranks(split.ulysses_group),
            "ring": dist.get_process_group_ranks(split.ring_group),
        }
        outs[ud] = usp.gather_sequence(usp.sp_attention(*(usp.shard_sequence(t, topo) for t in full), topo, backend="hybrid-u2"), topo)
    result["err"] = max(max_err(out, reference_attention(*full)) for out in outs.values())
    return result


# --------------------------------------------------------------------------- bad input

def _bad_init(env: Env) -> dict:
    p = env.world
    cases = {
        "sp_size None": lambda: usp.init_sequence_parallel(None),
        "sp_size 0": lambda: usp.init_sequence_parallel(0),
        "sp_size -2": lambda: usp.init_sequence_parallel(-2),
        "sp_size True": lambda: usp.init_sequence_parallel(True),
        "sp_size 2.0": lambda: usp.init_sequence_parallel(2.0),
        "sp_size not dividing": lambda: usp.init_sequence_parallel(p + 1 if p > 1 else 2),
        "ulysses_degree not dividing": lambda: usp.init_sequence_parallel(p, ulysses_degree=3 if p != 3 else 2),
        "layout unknown": lambda: usp.init_sequence_parallel(p, layout="diagonal"),
        "timeout negative": lambda: usp.init_sequence_parallel(p, timeout=-1),
    }
    if p > 1:
        cases["sp_size differs per rank"] = lambda: usp.init_sequence_parallel(1 if env.rank == 0 else p)
    return {name: raised(fn) for name, fn in cases.items()}


case("errors/init")(_bad_init)


def _bad_attention(env: Env) -> dict:
    topo, p, r = env.topo(), env.world, env.rank
    s = 4  # local tokens

    def t(b=2, seq=s, h=12, d=8, dtype=torch.float32):
        return torch.randn(b, seq, h, d, dtype=dtype)

    attn = usp.SequenceParallelAttention(topo, backend="ulysses")
    cases = {
        "q 3-D": lambda: attn(t()[0], t(), t()),
        "q not a tensor": lambda: attn([1.0], t(), t()),
        "integer input": lambda: attn(t().long(), t().long(), t().long()),
        "dtype mismatch": lambda: attn(t(), t(dtype=torch.float64), t(dtype=torch.float64)),
        "device mismatch": lambda: attn(t(), t().to("meta"), t().to("meta")),
        "k and v differ": lambda: attn(t(), t(), t(h=2)),
        "sequence mismatch": lambda: attn(t(), t(seq=2 * s), t(seq=2 * s)),
        "batch mismatch": lambda: attn(t(), t(b=3), t(b=3)),
        "head dim mismatch": lambda: attn(t(), t(d=4), t(d=4)),
        "kv heads not dividing q heads": lambda: attn(t(h=4), t(h=3), t(h=3)),
        "zero batch": lambda: attn(t(b=0), t(b=0), t(b=0)),
        "zigzag odd local length": lambda: attn(t(seq=3), t(seq=3), t(seq=3)),
        "bad softmax_scale": lambda: attn(t(), t(), t(), softmax_scale=-1.0),
        "window not positive": lambda: attn(t(), t(), t(), window=0),
        "window without causal": lambda: attn(t(), t(), t(), causal=False, window=4),
        "negative softcap": lambda: attn(t(), t(), t(), softcap=-1.0),
        "halo without a window": lambda: usp.sp_attention(t(), t(), t(), topo, backend="halo"),
        "blocks overlapping": lambda: attn(t(), t(), t(), blocks=[(0, 3), (2, 4)]),
        "blocks past the end": lambda: attn(t(), t(), t(), blocks=[(1, s * p + 1)]),
        "blocks without causal": lambda: attn(t(), t(), t(), causal=False, blocks=[(0, 2)]),
        "blocks crossing a document": lambda: attn(t(), t(), t(), cu_seqlens=[0, 2, s * p], blocks=[(1, 3)]),
        "cu_seqlens not ending at length": lambda: attn(t(), t(), t(), cu_seqlens=torch.tensor([0, 2, s * p - 1])),
        "cu_seqlens not increasing": lambda: attn(t(), t(), t(), cu_seqlens=torch.tensor([0, 3, 3, s * p])),
        "unknown backend (module)": lambda: usp.SequenceParallelAttention(topo, backend="ringg"),
        "unknown backend (functional)": lambda: usp.sp_attention(t(), t(), t(), topo, backend="ringg"),
        "shard length not divisible": lambda: usp.shard_sequence(torch.zeros(1, 2 * p + 1), topo),
    }
    if p > 1:
        # ulysses forced where check() says no: q heads not divisible by P, kv heads neither
        cases["ulysses q heads not divisible"] = lambda: attn(t(h=p + 1), t(h=1), t(h=1))
        cases["allgather heads_k_stride above kv heads"] = lambda: usp.sp_attention(t(), t(h=2), t(h=2), topo, backend="allgather_stride3")
        kv = 2 if p == 3 else 3  # neither divides the other
        cases["ulysses kv heads incompatible"] = lambda: attn(t(h=6 * p), t(h=kv), t(h=kv))
        # A shard length that differs between ranks: detected by the handshake, not a hang.
        # With the default shape_check="once" for shapes no rank has seen (batch 5 here)...
        cases["shard length differs per rank"] = lambda: attn(t(b=5, seq=s + 2 * r), t(b=5, seq=s + 2 * r), t(b=5, seq=s + 2 * r))
        cases["cu_seqlens differ per rank"] = lambda: attn(t(b=5), t(b=5), t(b=5), cu_seqlens=torch.tensor([0, 1 + r, s * p]))
        cases["blocks differ per rank"] = lambda: attn(t(b=5), t(b=5), t(b=5), blocks=[(0, 2 + r)])
        # ...and inputs that need a gradient on one rank only (the backward would carry different tensors)
        cases["requires_grad differs per rank"] = lambda: attn(t(b=6).requires_grad_(r == 0), t(b=6), t(b=6))
        dt = torch.float64 if r == 0 else torch.float32
        cases["dtype differs per rank"] = lambda: attn(t(b=7, dtype=dt), t(b=7, dtype=dt), t(b=7, dtype=dt))
    result = {name: raised(fn) for name, fn in cases.items()}
    # after all that, the group still works
    result["still works"] = tuple(attn(t(), t(), t()).shape)
    if p > 1:
        # ...and with shape_check="always" also when rank 0 falls back to a shape it already verified.
        strict = usp.SequenceParallelAttention(dataclasses.replace(topo, shape_check="always"), backend="ulysses")
        strict(t(), t(), t())
        result["seen shape differs per rank (always)"] = raised(lambda: strict(t(seq=s + 2 * r), t(seq=s + 2 * r), t(seq=s + 2 * r)))
    return result


case("errors/attention")(_bad_attention)


@case("errors/raise-mid-exchange", (2, 3, 4))
def raise_mid_exchange(env: Env) -> dict:
    """A kernel that raises on every rank between posting an exchange and waiting for it
    (ring hops, all-gather prefetch, the next head group's all-to-all): the error propagates, nothing stays in flight, and the
    next calls of every backend are exact."""
    from ulysses_sp import kernels

    topo = _topo_for(env, Parity(), "zigzag")
    gen = generator("raise-mid-exchange")
    full = [torch.randn(2, 48, h, 8, generator=gen, dtype=torch.float64) for h in (12, 2, 2)]
    ref_leaves = [t.clone().requires_grad_() for t in full]
    ref = reference_attention(*ref_leaves, causal=True)
    ref.sum().backward()
    result = {}
    kernel = kernels.get_kernel("torch")  # what auto runs here; the failure is injected into its instance
    pipelined = ("ulysses-g2",) if env.world == 2 else ()  # 6 q heads a rank: 2 groups (at P=3 ulysses refuses 2 kv heads)
    for backend in ("ring", "hybrid", "allgather_stride1", *pipelined):
        for where in ("block_forward", "block_backward"):
            original, calls = getattr(kernel, where), []

            def failing(*args, original=original, calls=calls, **kwargs):
                calls.append(1)
                if len(calls) == 1:  # the first block: a ring hop or the next head chunk's gather is in flight
                    raise RuntimeError("injected kernel failure")
                return original(*args, **kwargs)

            setattr(kernel, where, failing)
            try:
                shards = [usp.shard_sequence(t, topo).requires_grad_() for t in full]
                message = raised(lambda s=shards, b=backend: usp.sp_attention(*s, topo, backend=b).sum().backward(), RuntimeError)
            finally:
                delattr(kernel, where)
            shards = [usp.shard_sequence(t, topo).requires_grad_() for t in full]
            out = usp.sp_attention(*shards, topo, backend=backend)
            out.sum().backward()
            errors = [max_err(a, b) for a, b in zip(gather_all([out, *(s.grad for s in shards)], topo), [ref, *(t.grad for t in ref_leaves)])]
            result[f"{backend}/{where}"] = (message, max(errors))
    return result


@case("errors/head-groups-backward-twice", (2,))
def head_groups_backward_twice(env: Env) -> dict:
    """ulysses-g2's gradients take its saved q's memory: a second backward (retain_graph) raises, never silently wrong."""
    topo = _topo_for(env, Parity(), "zigzag")
    q, k, v = (torch.randn(1, 8, h, 4, dtype=torch.float64, requires_grad=True) for h in (4, 4, 4))
    out = usp.sp_attention(q, k, v, topo, backend="ulysses-g2")
    out.sum().backward(retain_graph=True)
    try:
        out.sum().backward()
    except RuntimeError as e:
        return {"second": str(e)}
    return {"second": None}


@case("errors/non-finite")
def non_finite_input(env: Env) -> dict:
    """NaN in k, Inf in q: NaN wherever one-process attention has NaN, on every rank; no hang."""
    topo = _topo_for(env, Parity(), "zigzag")
    gen = generator("non-finite")
    result = {}
    for what, causal in (("nan in k", False), ("inf in q", True)):
        full = [torch.randn(1, 48, h, 8, generator=gen, dtype=torch.float64) for h in (12, 1, 1)]
        if what == "nan in k":
            full[1][:, 0] = float("nan")
        else:
            full[0][:, 7, 3] = float("inf")
        leaves = [t.clone().requires_grad_() for t in full]
        ref = reference_attention(*leaves, causal=causal)
        ref.sum().backward()
        # out and dq: NaN exactly where the reference has it. dk and dv: NaN on at least every key that a NaN
        # query row sees, and at most where the reference has it: a softmax row holding NaN spreads it to every
        # key of its block, masked ones included, so the rest depends on how keys are cut into blocks
        rows = ref.detach().isnan().any(-1).any(-1)  # [b, s]: a query row with NaN, in any head
        keys = rows.flip(1).cummax(1).values.flip(1) if causal else rows.any(1, keepdim=True).expand_as(rows)
        seen = keys[:, :, None, None].expand_as(full[1])
        ref_masks = [ref.detach().isnan(), leaves[0].grad.isnan(), leaves[1].grad.isnan(), leaves[2].grad.isnan()]
        for backend in BACKENDS:
            shards = [usp.shard_sequence(t, topo).requires_grad_() for t in full]
            out = usp.sp_attention(*shards, topo, backend=backend, causal=causal)
            out.sum().backward()
            masks = [t.isnan() for t in gather_all([out, *(s.grad for s in shards)], topo)]
            result[f"{backend}/{what}"] = {
                "nan masks as expected": [bool(torch.equal(a, b)) for a, b in zip(masks[:2], ref_masks[:2])]
                + [bool((a >= seen).all() and (a <= b).all()) for a, b in zip(masks[2:], ref_masks[2:])],
                "reference nan count": [int(m.sum()) for m in ref_masks],
                "local out has nan": bool(out.isnan().any()),
                "grads have nan": [bool(s.grad.isnan().any()) for s in shards],
            }
    return result


@case("bench/rounds", worlds=(2,))
def bench_rounds(env: Env) -> dict:
    """sp-bench's order of calls in a cell: each entry's warmup and T1's, then rounds in which every
    entry and T1 run once, the order rotating; run i of each is its call in round i. Entries are stand-ins."""
    from ulysses_sp.cli import bench

    calls = []

    def entry(name, cell, topo_for, kernel):
        if name == "peer:skip":
            return None, None, "cannot run"
        return name, topo_for(cell.layout), None

    def run_once(fn, shards, dout, device, group, memory):
        calls.append(fn)
        return (len(calls), 0.0, 0, 0, 0), None, None

    def run_baseline(cell, full, device, group, kernel):
        calls.append("T1")
        return len(calls) if env.rank == 0 else None

    real = bench._entry, bench._run_once, bench._run_baseline
    bench._entry, bench._run_once, bench._run_baseline = entry, run_once, run_baseline
    try:
        cell = bench.Cell(8, 2, 2, 4, 1, "float32", True, "zigzag")
        results = bench.measure_rank([cell], ["peer:a", "peer:skip", "peer:b", "peer:c"], warmup=1, repeat=4, check=False,
                                     topo_args={"timeout": 60}, progress=False, baseline=True)
        nothing_runs = bench.measure_rank([cell], ["peer:skip"], warmup=1, repeat=4, check=False, topo_args={"timeout": 60}, progress=False,
                                          baseline=True)
    finally:
        bench._entry, bench._run_once, bench._run_baseline = real
    runs = {name: [run if name == bench.BASELINE else run[0] for run in r["runs"]] for (_, name), r in results.items() if "runs" in r}
    return {"calls": calls, "runs": runs,
            "skipped": {name: r["skipped"] for (_, name), r in results.items() if "skipped" in r}, "nothing_runs": nothing_runs}




from . import reliability_cases  # noqa: E402,F401
from . import loss_cases  # noqa: E402,F401
from . import tiling_cases  # noqa: E402,F401
from . import fsdp_cases  # noqa: E402,F401
from . import compile_cases  # noqa: E402,F401
from . import vlm_cases  # noqa: E402,F401
from . import rl_cases  # noqa: E402,F401
from . import dropout_cases  # noqa: E402,F401
from . import step_memory_cases  # noqa: E402,F401
