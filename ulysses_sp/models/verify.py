"""``verify_sequence_parallel``: prove that SP computes the same model as one process, for the
user's own architecture, before any GPU time is spent on training it.

A small copy of the architecture (`shrink_config`: every kind of layer kept, small
widths, fp64) runs one forward and backward on random tokens in one process and under SP on
the given topology, unpacked and packed; the loss and every parameter's gradient are compared.
Uncovered token mixers are refused by ``apply_sequence_parallel`` before anything runs.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import comm
from ..data import model_inputs, shard_batch, sp_cross_entropy
from ..devices import move_batch
from .shrink import check_small, no_randomness, shrink_config, shrink_text
from .switch import apply_sequence_parallel, chosen_backends, remove_sequence_parallel
from .token_mixers import check_supported, mixer_layers, packing_refused

__all__ = ["SequenceParallelMismatch", "VerifyReport", "verify_sequence_parallel"]


class SequenceParallelMismatch(AssertionError):
    """SP gave another loss or gradients than one process, past the tolerance."""


@dataclasses.dataclass
class VerifyReport:
    """What `verify_sequence_parallel` measured; ``str(report)`` is its one-line summary.

    Attributes:
        architecture: the model class verified.
        sp_size: ranks of the SP group.
        layers: decoder layers of the copy that ran.
        loss_error: relative error of the SP loss against one process, per run (``unpacked``,
            ``packed``).
        grad_errors: per run, each parameter's worst relative gradient error (max abs difference
            over the max abs of the one-process gradient).
        backends: the backends each attention layer ran.
        mixers: the strategy each other token mixer (hybrid models) ran, by module path.
        seconds: wall time of the check.
        tolerance: the relative error allowed.
        rounding_noise: how far the one-process gradients move when the same sums are only
            re-associated (the loss's two halves backpropagated apart and added): about 1e-16 for
            a model in fp64 throughout, 1e-7 to 1e-5 where its own code computes in float32
            (Gemma 3's norms, Gated DeltaNet and Mamba scans). SP re-associates the same way, so
            its error is measured against this.
    """

    architecture: str
    sp_size: int
    layers: int
    loss_error: dict[str, float]
    grad_errors: dict[str, dict[str, float]]
    backends: dict[int, list[str]]
    mixers: dict[str, str]
    seconds: float
    tolerance: float
    rounding_noise: float = 0.0

    @property
    def worst(self) -> tuple[str, str, float]:
        """(run, parameter or ``"loss"``, relative error) of the largest error."""
        rows = [(run, "loss", e) for run, e in self.loss_error.items()]
        rows += [(run, name, e) for run, errs in self.grad_errors.items() for name, e in errs.items()]
        return max(rows, key=lambda r: r[2])

    @property
    def passed(self) -> bool:
        return self.worst[2] <= self.tolerance

    def __str__(self) -> str:
        run, name, err = self.worst
        verdict = "exact" if self.passed else "MISMATCH"
        mixers = f", mixers {sorted(set(self.mixers.values()))} on {len(self.mixers)} layers" if self.mixers else ""
        inside = f" (one-process rounding noise {self.rounding_noise:.0e})"
        return (f"{self.architecture} under SP={self.sp_size} ({self.layers} layers, backends {self.backends}{mixers}): {verdict}, worst "
                f"relative error {err:.2e} ({name}, {run}) against tolerance {self.tolerance:.0e}{inside}, in {self.seconds:.1f} s")


def _image_text(config):
    """`.verify_image_text` for an image-text config of a tested family, None for a text
    model's; raises ``ValueError`` naming any other model with inputs besides text."""
    if getattr(config, "vision_config", None) is None and getattr(config, "audio_config", None) is None:
        return None
    from . import image_text, verify_image_text

    audio = getattr(config, "audio_config", None) is not None and config.model_type not in image_text.AUDIO + image_text.AUDIO_BY_ENCODER
    if config.model_type not in image_text.TESTED or audio:
        raise ValueError(f"verify_sequence_parallel checks text causal LMs and the image-text families ulysses_sp switches "
                         f"({', '.join(image_text.TESTED)}); {type(config).__name__} ({config.model_type}) is neither")
    return verify_image_text


def _build(config, device, seed: int):
    import transformers

    try:  # sdpa where the family has it: eager takes softmax in fp32 in some, which would blur fp64
        torch.manual_seed(seed)  # experts as a loop of matmuls: grouped_mm takes no fp64
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", experts_implementation="eager")
    except ValueError:
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", experts_implementation="eager")
    return model.to(device=device, dtype=torch.float64).train()


def _batch(config, seq_len: int, packed: bool, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (1, seq_len), generator=g)
    out = {"input_ids": ids, "labels": ids.clone()}
    if packed:  # four documents of unequal lengths; positions restart in each
        cuts = [0, seq_len // 7, seq_len // 7 + 2, (3 * seq_len) // 5, seq_len]
        pos = torch.cat([torch.arange(b - a) for a, b in zip(cuts, cuts[1:])]).unsqueeze(0)
        out["position_ids"] = pos
        out["labels"] = ids.masked_fill(pos == 0, -100)
    return out


def _grads(ref, loss: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """``loss`` and ``ref``'s gradients of it (None where a parameter gets none)."""
    ref.zero_grad(set_to_none=True)
    loss.backward()
    grads = [None if p.grad is None else p.grad.detach().clone() for p in ref.parameters()]
    ref.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _noise_part(ref, data, device, part: str):
    """The loss summed over the ``part`` (whole, first or second half) of the tokens, and its gradients."""
    ids, labels = data["input_ids"].to(device), data["labels"].to(device)
    losses = F.cross_entropy(ref(input_ids=ids).logits[0, :-1], labels[0, 1:], reduction="none")
    half = losses.numel() // 2
    return _grads(ref, {"whole": losses, "first": losses[:half], "second": losses[half:]}[part].sum())


def _rounding_noise(whole: list, first: list, second: list) -> float:
    """The largest relative change of any one-process gradient when the loss over the first and
    the second half of the tokens are backpropagated apart and added: the rounding of the model's
    own arithmetic under re-association, which is all SP changes when it is exact."""
    def dense(grads):
        return [torch.zeros(()) if g is None else g for g in grads]

    whole, first, second = dense(whole), dense(first), dense(second)
    floor = 1e-6 * max(g.abs().max().item() for g in whole)
    return max(_rel(a + b, w, floor) for a, b, w in zip(first, second, whole))


def _spread(jobs: list, ref, topo) -> list:
    """``[job() for job in jobs]``, each job run on one rank of the SP group (job i on rank
    i % sp_size) and its result, a loss and ``ref``'s gradients, broadcast to the others: the
    one-process references cost each rank a share of them instead of all five (at P=4: two on
    one rank, one on each other)."""
    if topo.sp_size == 1:
        return [job() for job in jobs]
    params = list(ref.parameters())
    size = 2 + len(params) + sum(p.numel() for p in params)
    me, out = dist.get_rank(topo.sp_group), []
    for i, job in enumerate(jobs):
        owner, failure = i % topo.sp_size, None
        flat = torch.zeros(size, dtype=torch.float64, device=topo.device)
        if owner == me:  # [failed, loss, whether each parameter has a gradient, the gradients]
            try:
                loss, grads = job()
                flat = torch.cat([torch.zeros(1, dtype=torch.float64, device=topo.device), loss.reshape(1).double(),
                                  torch.tensor([g is not None for g in grads], dtype=torch.float64, device=topo.device)]
                                 + [(torch.zeros_like(p) if g is None else g).flatten().double() for p, g in zip(params, grads)])
            except Exception as e:  # told to every rank, which would otherwise wait in the broadcast until the timeout
                failure = e
                flat[0] = 1
        src = dist.get_global_rank(topo.sp_group, owner)
        dist.broadcast(flat, src=src, group=topo.sp_group)
        if flat[0].item():
            why = comm.broadcast_object(None if failure is None else f"{type(failure).__name__}: {failure}", src=src, group=topo.sp_group)
            raise RuntimeError(f"verify_sequence_parallel: the one-process run of the reference on SP rank {owner} failed: {why}") from failure
        out.append(flat[1:])
    results = []
    for flat in out:  # the reference model is fp64 throughout: the owner's values, bit for bit
        loss, has, rest = flat[0], flat[1:1 + len(params)], flat[1 + len(params):].split([p.numel() for p in params])
        results.append((loss, [g.view_as(p) if h else None for g, h, p in zip(rest, has.tolist(), params)]))
    return results


def _reference_key(ref, inputs, packed: tuple) -> str:
    """What the one-process runs depend on: the model's class, config, parameters and buffers,
    the inputs they run on and the runs asked for."""
    digest = hashlib.sha256(f"{type(ref).__qualname__}|{ref.config.to_json_string()}|{packed}".encode())

    def add(x) -> None:
        if isinstance(x, torch.Tensor):
            x = x.detach().cpu().contiguous()
            digest.update(f"{x.dtype}{tuple(x.shape)}".encode())
            digest.update(x.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                digest.update(str(k).encode())
                add(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                add(v)
        else:
            digest.update(repr(x).encode())

    add(list(ref.parameters()) + list(ref.buffers()))
    add(inputs)
    return digest.hexdigest()


def _everyone_has(found: bool, topo) -> bool:
    """Whether every rank of the SP group found the one-process runs kept (else all run them:
    the runs hold collectives)."""
    if topo.sp_size == 1:
        return found
    return all(has for (has,) in comm.all_gather_ints([int(found)], topo.sp_group, topo.device))


def _one_process_loss(ref, data, device) -> torch.Tensor:
    """The mean next-token loss of one process. Packed documents run one by one: packing must
    give each document what it would get alone (some families' own forward, OPT's for one,
    would let a packed document attend to the one before it)."""
    ids, labels = data["input_ids"].to(device), data["labels"].to(device)
    position_ids = data.get("position_ids")
    if position_ids is None:
        return F.cross_entropy(ref(input_ids=ids).logits[0, :-1], labels[0, 1:], ignore_index=-100)
    starts = (position_ids[0] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
    total = ids.new_zeros((), dtype=torch.float64)
    for a, b in zip(starts, starts[1:]):
        logits = ref(input_ids=ids[:, a:b]).logits
        total = total + F.cross_entropy(logits[0, :-1], labels[0, a + 1:b], ignore_index=-100, reduction="sum")
    return total / (labels[0, 1:] != -100).sum()


def _rel(a, b, floor: float) -> float:
    """Max abs difference over the max abs of ``b``, at least ``floor``: a gradient that is zero in
    exact arithmetic (a key bias under softmax) is rounding noise, and its relative error none."""
    return ((a - b).abs().max() / b.abs().max().clamp(min=floor)).item()


def _one_run(ref, topo, data, reference, backend, kernel, mixer) -> tuple[float, dict[str, float], dict[int, list[str]], dict[str, str]]:
    """SP on a copy of ``ref``, against ``reference``: the one-process loss and gradients on ``data``."""
    device = topo.device
    sp_model = copy.deepcopy(ref)
    ref_loss, ref_grads = reference

    apply_sequence_parallel(sp_model, topo, backend=backend, kernel=kernel, mixer=mixer)
    try:
        local = move_batch(shard_batch(data, topo), device)
        loss = sp_cross_entropy(sp_model(**model_inputs(local)).logits, local["shift_labels"], topo)
        loss.backward()
    finally:
        chosen, mixers = chosen_backends(sp_model), mixer_layers(sp_model)
        remove_sequence_parallel(sp_model)
    names, params = zip(*sp_model.named_parameters())
    # every parameter, on every rank alike: a rank encoding no image has zero gradients where another has none
    mine = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    summed = comm.all_reduce_sums(mine, topo.sp_group) if topo.sp_size > 1 else mine  # the SP group's gradient is the sum of its ranks'
    grads = {name: (grad, torch.zeros_like(p) if ref_grad is None else ref_grad) for name, p, grad, ref_grad in zip(names, params, summed, ref_grads)}
    floor = 1e-6 * max(r.abs().max().item() for _, r in grads.values())
    errors = {name: _rel(grad, ref_grad, floor) for name, (grad, ref_grad) in grads.items()}
    return abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()), errors, chosen, mixers


def verify_sequence_parallel(model_or_config, topo, *, backend="auto", kernel: str = "auto", mixer: str = "auto", shrink: bool = True, seq_len: int | None = None,
                             tolerance: float | None = None, packed: tuple[bool, ...] | None = None, seed: int = 0,
                             raise_on_mismatch: bool = True, references: dict | None = None) -> VerifyReport:
    """Check that SP computes the same loss and every gradient as one process for an architecture.

    Runs one forward and backward on random tokens in one process and under SP, unpacked and
    packed (the packed reference runs each document alone), in fp64, and compares the loss and
    every parameter's gradient. Every rank of the SP group must call it.

    An image-text model of the families ulysses_sp switches (``image_text.TESTED``) runs with random
    images (`.verify_image_text`: one across a shard boundary; packed, a document without any);
    other models with inputs besides text are refused by name.

    ``shrink`` (default) runs a small copy of the architecture (`shrink_config`) built
    from the config with random weights in fp64 on ``topo.device``; ``shrink=False`` copies
    the given model (or builds the config as it is), so keep it small. ``seq_len`` defaults to
    ``12 * sp_size + 5`` tokens (padding included). ``backend``, ``kernel`` and ``mixer`` are
    ``apply_sequence_parallel``'s.

    Args:
        model_or_config (PreTrainedModel | PretrainedConfig): the model, or its config.
        topo (Topology): the topology from `ulysses_sp.init_sequence_parallel`.
        backend (str | list | Callable): as for `ulysses_sp.apply_sequence_parallel`.
        kernel: as for `ulysses_sp.apply_sequence_parallel`.
        mixer: as for `ulysses_sp.apply_sequence_parallel`.
        shrink: run a small copy of the architecture (`shrink_config`).
        seq_len: tokens per row (default ``12 * sp_size + 5``).
        tolerance: the relative error allowed; default 1e-6, or 10 times the model's own
            rounding noise where that is larger (`VerifyReport.rounding_noise`).
        packed: the runs to make: unpacked (False) and packed (True); default both, or unpacked alone for a
            model that refuses packed rows (DeepSeek-V4: `packing_refused`).
        seed: seed of the copy's weights and the random tokens.
        raise_on_mismatch: raise past the tolerance (else only report it).
        references: a dict that keeps the one-process runs between calls, keyed by the model's
            class, config and weights and the inputs: pass the same one to calls on one
            architecture (each backend, layout or mixer strategy) and they run once. Every rank
            must pass a dict; where one lacks the runs, all ranks run them.

    Returns:
        The `VerifyReport`.

    Raises:
        SequenceParallelMismatch: SP is off by more than ``tolerance``, naming the worst
            parameters (with ``raise_on_mismatch``).
        ValueError: a model SP does not cover (from ``apply_sequence_parallel``), or an
            image-text or audio-text family it does not split.
    """
    started = time.perf_counter()
    config = getattr(model_or_config, "config", model_or_config)
    image_text = _image_text(config)  # before any collective: every rank refuses alike
    build = image_text.build if image_text else _build
    if shrink:
        config = image_text.shrink_image_text_config(config, shrink_text) if image_text else shrink_config(config)
        check_small(config)
        ref = build(config, topo.device, seed)
    elif config is model_or_config:
        config = copy.deepcopy(config)
        no_randomness(config)
        ref = build(config, topo.device, seed)
    else:
        ref = copy.deepcopy(model_or_config).to(device=topo.device, dtype=torch.float64).train()
        no_randomness(ref)
    check_supported(ref, topo, mixer)  # a model SP does not cover is refused before anything runs
    if packed is None:
        packed = (False,) if packing_refused(ref) else (False, True)
    device = topo.device
    if image_text:  # rows of random images; each document's own inputs for one process
        rows = {is_packed: image_text.rows(config, topo.sp_size, is_packed, seed + 1) for is_packed in (False, *packed)}
        batches = {is_packed: batch for is_packed, (batch, _) in rows.items()}
        alone = rows[False][1][0]
        jobs = [functools.partial(lambda part: _grads(ref, image_text.noise_part(ref, alone, device, part)), part) for part in ("whole", "first", "second")]
        jobs += [functools.partial(lambda docs: _grads(ref, image_text.one_process_loss(ref, docs, device)), rows[is_packed][1]) for is_packed in packed]
    else:
        seq_len = seq_len or 12 * topo.sp_size + 5
        batches = {is_packed: _batch(config, seq_len, is_packed, seed + 1) for is_packed in (False, *packed)}
        jobs = [functools.partial(_noise_part, ref, batches[False], device, part) for part in ("whole", "first", "second")]
        jobs += [functools.partial(lambda data: _grads(ref, _one_process_loss(ref, data, device)), batches[is_packed]) for is_packed in packed]
    key = None if references is None else _reference_key(ref, rows if image_text else batches, packed)
    if key is not None and _everyone_has(key in references, topo):
        noise, one_process = references[key]
    else:
        done = _spread(jobs, ref, topo)
        noise, one_process = _rounding_noise(*(grads for _, grads in done[:3])), dict(zip(packed, done[3:]))
        if key is not None:
            references[key] = noise, one_process
    if tolerance is None:
        tolerance = max(1e-6, 10 * noise)
    if isinstance(backend, (list, tuple)):  # one name per layer: the copy keeps a prefix of the layers
        backend = list(backend).__getitem__
    loss_error, grad_errors, backends, mixers = {}, {}, {}, {}
    for is_packed in packed:
        run = "packed" if is_packed else "unpacked"
        loss_error[run], grad_errors[run], chosen, mixers = _one_run(ref, topo, batches[is_packed], one_process[is_packed], backend, kernel, mixer)
        for layer, names in chosen.items():
            backends[layer] = sorted(set(backends.get(layer, [])) | set(names))
    report = VerifyReport(type(ref).__name__, topo.sp_size, config.get_text_config().num_hidden_layers, loss_error, grad_errors, backends, mixers,
                          time.perf_counter() - started, tolerance, noise)
    if raise_on_mismatch and not report.passed:
        worst = sorted(((e, f"{name} ({run})") for run, errs in grad_errors.items() for name, e in errs.items()), reverse=True)[:5]
        shown = ", ".join(f"{name} {e:.2e}" for e, name in worst if e > tolerance)
        raise SequenceParallelMismatch(
            f"{report}; loss errors {({k: f'{v:.2e}' for k, v in loss_error.items()})}; worst gradients: {shown or 'none past the tolerance'}")
    return report
