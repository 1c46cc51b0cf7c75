"""Docstrings of the public API, read as mkdocstrings reads them (griffe, Google style).

For every public name (``PUBLIC``), each documented once (an integration's function that
``ulysses_sp`` exports under the same name has a one-line docstring naming the top-level one,
which holds the documentation): a docstring whose first line is a one-line summary; no
warning from griffe's Google parser (with the options of ``mkdocs.yml``, where a warning fails
``mkdocs build --strict``: a documented parameter missing from the signature, one with no type
or annotation, a malformed entry); every parameter of the signature in ``Args`` (classes: the
``__init__``'s, in the class docstring, which mkdocs merges), every field of a dataclass in
``Attributes``; ``Returns`` where the function returns a value; and every exception the code
itself raises (``raise SomeError(...)`` in its body) in ``Raises``. Also every command and option
of ``sp-bench`` has a help text. Static: nothing runs, no ranks.
"""

from __future__ import annotations

import ast
import builtins
import logging
import textwrap
from pathlib import Path

import click
import griffe
import pytest

ROOT = Path(__file__).resolve().parents[1]

PUBLIC = {
    "ulysses_sp": [
        "init_sequence_parallel", "apply_sequence_parallel", "remove_sequence_parallel", "verify_sequence_parallel", "Topology",
        "SequenceParallelAttention", "sp_attention", "shard_sequence", "gather_sequence", "shard_batch", "cu_seqlens_from_position_ids",
        "sp_cross_entropy", "model_inputs", "target_counts", "sp_linear_cross_entropy", "causal_lm_loss", "SequenceParallelSampler",
        "pad_to_multiple", "CommCounter", "comm", "register_backend", "get_backend", "list_backends", "AttnSpec", "Estimate", "Profile",
        "LinkCost", "load_profile", "CPU_GLOO_PROFILE", "CPU_GLOO_PROFILE_P4", "default_profile", "NVLINK_PROFILE",
    ],
    "ulysses_sp.models.switch": [
        "ATTN_IMPLEMENTATION", "apply_sequence_parallel", "chosen_backends", "remove_sequence_parallel", "sp_attention_forward", "switched_model",
    ],
    "ulysses_sp.integrations.trainer": ["SequenceParallelTrainingArguments", "SequenceParallelTrainer", "PREDICT_LOGITS"],
    "ulysses_sp.integrations.deepspeed": ["SequenceParallelMPU", "gradient_scale", "DistributedAttention", "use_cpu_accelerator_if_needed"],
    "ulysses_sp.integrations.fsdp": ["device_mesh", "apply_fsdp2"],
    "ulysses_sp.integrations.trl": [
        "SequenceParallelSFTConfig", "SequenceParallelSFTTrainer", "SequenceParallelDPOConfig", "SequenceParallelDPOTrainer",
        "SequenceParallelGRPOConfig", "SequenceParallelGRPOTrainer", "sequence_parallel_fused_head",
    ],
    "ulysses_sp.models.verify": ["SequenceParallelMismatch", "VerifyReport", "verify_sequence_parallel"],
    "ulysses_sp.models.shrink": ["shrink_config"],
    "ulysses_sp.models.image_text": ["STYLES", "TESTED", "decoder_to_switch", "is_split", "text_decoder", "split_at_decoder", "unsplit"],
    "ulysses_sp.step_memory": ["ENGINES", "Breakdown", "Engine", "Switches", "World", "estimate", "max_seq_len", "model_states"],
    "ulysses_sp.tiling": [
        "CHECKPOINT_MODES", "OffloadStore", "TiledMLP", "TiledMLPFunction", "checkpoint_layers", "compile_layers", "default_tile_tokens",
        "offload_store", "tile_count", "tile_mlp", "tile_norms", "norms", "untile_mlp", "uncheckpoint_layers", "validate_options",
    ],
    "ulysses_sp.rl": ["token_logprobs", "sequence_ids", "sequence_sums", "sequence_logprobs", "token_mean"],
}
"""Module -> its public names: its ``__all__`` (``test_public_lists_are_the_modules_all`` keeps them equal)."""

FULLY_DOCUMENTED_METHODS = ["ulysses_sp.SequenceParallelAttention.forward"]
"""Methods held to the functions' rules (the others: griffe's warnings and an exact ``Args`` where there is one)."""

NAMES = [(module, name) for module, names in PUBLIC.items() for name in names]


@pytest.fixture(scope="module")
def package():
    return griffe.load("ulysses_sp", search_paths=[str(ROOT)], resolve_aliases=False)


def _get(package, path: str):
    obj = package
    for part in path.split(".")[1:]:
        obj = obj[part]
    return obj.final_target if obj.is_alias else obj


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _parse(obj) -> tuple[dict, list[str]]:
    """The docstring's sections by kind (``parameters``, ``attributes``, ``returns``, ``raises``...)
    and the warnings griffe's Google parser gave."""
    handler, logger = _Warnings(), logging.getLogger("griffe")
    logger.addHandler(handler)
    try:
        sections = griffe.Docstring(obj.docstring.value, lineno=obj.docstring.lineno, parent=obj, parser="google").parse()
    finally:
        logger.removeHandler(handler)
    by_kind: dict = {}
    for section in sections:
        by_kind.setdefault(section.kind.value, []).extend(section.value if isinstance(section.value, list) else [section.value])
    return by_kind, handler.messages


def _body(obj) -> list[ast.stmt]:
    """The statements of a function's own body (griffe's source of it, parsed)."""
    tree = ast.parse(textwrap.dedent(obj.source))
    return tree.body[0].body if tree.body and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)) else []


def _own_nodes(statements):
    """The nodes of ``statements``, not descending into nested functions, lambdas or classes."""
    nested = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
    stack = [node for node in statements if not isinstance(node, nested)]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(child for child in ast.iter_child_nodes(node) if not isinstance(child, nested))


def _raised(obj) -> set[str]:
    """Exception classes a function raises itself: ``raise Name(...)`` / ``raise Name`` in its body."""
    found = set()
    for node in _own_nodes(_body(obj)):
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and (exc.id.endswith(("Error", "Exception", "Mismatch")) or isinstance(getattr(builtins, exc.id, None), type)):
                found.add(exc.id)
    return found


def _returns_value(obj) -> bool:
    return any(isinstance(node, ast.Return) and node.value is not None and not (isinstance(node.value, ast.Constant) and node.value.value is None)
               for node in _own_nodes(_body(obj)))


def _names(entries) -> set[str]:
    return {entry.name.lstrip("*") for entry in entries}


def _check_summary(path: str, obj) -> list[str]:
    lines = obj.docstring.value.strip().splitlines()
    problems = []
    if not lines or not lines[0].strip():
        problems.append(f"{path}: empty docstring")
    elif len(lines) > 1 and lines[1].strip():
        problems.append(f"{path}: the summary is more than one line: {lines[:2]}")
    elif not lines[0].rstrip().endswith("."):
        problems.append(f"{path}: the summary line is not a sentence: {lines[0]!r}")
    return problems


def _check_function(path: str, obj, sections: dict, *, skip_self: bool) -> list[str]:
    problems = []
    variadic = {griffe.ParameterKind.var_positional, griffe.ParameterKind.var_keyword}
    params = [p for p in obj.parameters if not (skip_self and p.name in ("self", "cls"))]
    documented = _names(sections.get("parameters", []))
    missing = [p.name for p in params if p.kind not in variadic and p.name not in documented]
    unknown = documented - {p.name for p in params}
    if missing:
        problems.append(f"{path}: parameters not in Args: {missing}")
    if unknown:
        problems.append(f"{path}: Args names what the signature lacks: {sorted(unknown)}")
    if _returns_value(obj) and "returns" not in sections:
        problems.append(f"{path}: returns a value but has no Returns section")
    raised = _raised(obj) - {str(r.annotation).split(".")[-1] for r in sections.get("raises", [])}
    if raised:
        problems.append(f"{path}: raises {sorted(raised)} without saying so in Raises")
    return problems


def _dataclass_fields(obj) -> list[str]:
    return [name for name, member in obj.members.items()
            if not member.is_alias and member.is_attribute and "instance-attribute" in member.labels and member.annotation is not None
            and not str(member.annotation).startswith(("ClassVar", "typing.ClassVar"))]


def _check_class(path: str, obj, sections: dict) -> list[str]:
    problems = []
    if "dataclass" in obj.labels:
        documented = _names(sections.get("attributes", []))
        missing = [f for f in _dataclass_fields(obj) if f not in documented]
        unknown = [a for a in documented if a not in obj.all_members]
        if missing:
            problems.append(f"{path}: dataclass fields not in Attributes: {missing}")
        if unknown:
            problems.append(f"{path}: Attributes names what the class lacks: {unknown}")
        if "parameters" in sections:
            problems.append(f"{path}: a dataclass documents its fields under Attributes, not Args")
        init = None
    else:
        init = obj.members.get("__init__")
    if init is not None:  # merge_init_into_class: the class docstring documents __init__
        problems += _check_function(f"{path}.__init__", init, sections, skip_self=True)
    elif "parameters" in sections and "dataclass" not in obj.labels:
        problems.append(f"{path}: Args without an __init__ of its own")
    raised = set()
    for name in ("__post_init__",):
        if name in obj.members and not obj.members[name].is_alias:
            raised |= _raised(obj.members[name])
    raised -= {str(r.annotation).split(".")[-1] for r in sections.get("raises", [])}
    if raised:
        problems.append(f"{path}: __post_init__ raises {sorted(raised)} without saying so in Raises")
    return problems


def test_public_lists_are_the_modules_all(package):
    for module in PUBLIC:
        obj = _get(package, module)
        assert [str(name) for name in obj.exports] == PUBLIC[module], f"{module}.__all__ changed: update PUBLIC here and document the new names"


@pytest.mark.parametrize("module,name", NAMES, ids=[f"{m.removeprefix('ulysses_sp.')}.{n}" for m, n in NAMES])
def test_public_name_is_documented(package, module, name):
    path = f"{module}.{name}"
    obj = _get(package, path)
    assert obj.docstring is not None and obj.docstring.value.strip(), f"{path} has no docstring"
    problems = _check_summary(path, obj)
    pointer = f"ulysses_sp.{name}"
    if module != "ulysses_sp" and ("ulysses_sp", name) in NAMES and pointer in obj.docstring.value:
        # documented once: the implementation behind a top-level name points there (checked as its own case)
        assert len(obj.docstring.value.strip().splitlines()) == 1, f"{path}: a pointer to {pointer} is one line"
        return
    sections, warnings = _parse(obj)
    problems += [f"{path}: griffe: {w}" for w in warnings]
    if obj.is_function:
        problems += _check_function(path, obj, sections, skip_self=False)
    elif obj.is_class:
        problems += _check_class(path, obj, sections)
    assert not problems, "\n".join(problems)


def _public_methods(package):
    for module, name in NAMES:
        obj = _get(package, f"{module}.{name}")
        if not obj.is_class:
            continue
        for member_name, member in obj.members.items():
            if member.is_alias or member_name.startswith("_") or member.docstring is None:
                continue
            if member.is_function or member.is_attribute:
                yield f"{module}.{name}.{member_name}", member


def test_documented_methods_parse_cleanly(package):
    """What mkdocs renders of the public classes' members: no griffe warning, and an ``Args`` (where there is
    one) that names exactly the signature's parameters."""
    problems = []
    seen = set()
    for path, member in _public_methods(package):
        seen.add(path)
        sections, warnings = _parse(member)
        problems += [f"{path}: griffe: {w}" for w in warnings]
        if member.is_function and ("parameters" in sections or path in FULLY_DOCUMENTED_METHODS):
            found = _check_function(path, member, sections, skip_self=True)
            problems += found if path in FULLY_DOCUMENTED_METHODS else [p for p in found if "Args" in p]
            problems += _check_summary(path, member) if path in FULLY_DOCUMENTED_METHODS else []
    problems += [f"{path}: no docstring" for path in FULLY_DOCUMENTED_METHODS if path not in seen]
    assert not problems, "\n".join(problems)


def _commands(command: click.Command, prefix: str):
    yield prefix, command
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from _commands(sub, f"{prefix} {name}")


def test_sp_bench_commands_and_options_have_help():
    from ulysses_sp.cli.main import main

    problems = []
    commands = list(_commands(main, "sp-bench"))
    assert len(commands) >= 6, [c for c, _ in commands]
    for name, command in commands:
        if not (command.help or "").strip():
            problems.append(f"{name}: no help text")
        for param in command.params:
            if isinstance(param, click.Option) and not (param.help or "").strip():
                problems.append(f"{name} {param.opts[0]}: no help text")
            elif isinstance(param, click.Argument) and param.name.upper() not in (command.help or "").upper():
                problems.append(f"{name}: argument {param.name} is not described in the command's help")
    assert not problems, "\n".join(problems)
