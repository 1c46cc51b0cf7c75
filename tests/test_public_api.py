"""The public names no other test exercises directly: model_inputs, target_counts,
list_backends, ``sp-bench backends`` and CommCounter nesting."""

import pytest
from click.testing import CliRunner

import ulysses_sp as usp
from ulysses_sp.cli.main import main as sp_bench

from .conftest import values

BUILT_IN = ["ulysses", "allgather", "ring", "hybrid", "halo"]


@pytest.mark.parametrize("world", [2, 3])
def test_model_inputs_target_counts_and_nested_counters(ranks, world):
    for r in values(ranks(world), "data/public-helpers"):
        assert r["packed keys"] == ["cu_seq_lens_q", "input_ids", "position_ids"] and r["same tensors"], r
        assert r["plain keys"] == ["input_ids", "position_ids"], r  # no document boundaries without packing
        assert r["counts"] == r["counts one process"] and r["counts dtype"] == "torch.float64", r
        assert r["inner"] == {"all_gather": (1, 12 * (world - 1)), "all_reduce": (1, r["inner"]["all_reduce"][1])}, r
        assert r["outer"]["all_gather"] == (2, 24 * (world - 1)) and r["outer"]["all_reduce"] == r["inner"]["all_reduce"], r


@pytest.mark.quick
def test_list_backends_names_the_built_in_ones_in_order():
    names = usp.list_backends()
    assert names[: len(BUILT_IN)] == BUILT_IN, names


def test_sp_bench_backends_lists_every_backend():
    result = CliRunner().invoke(sp_bench, ["backends"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    listed = [line.split()[0] for line in result.output.splitlines() if line.strip()]
    assert set(BUILT_IN) <= set(listed) and "hybrid-u{U}" in listed, result.output


def test_strategies_do_not_import_transformers_or_the_models():
    """``backends/`` and ``mixers/`` are generic, below the models: model-specific code registers
    with them (``register_backend``, ``register_adapter``, ``register_reach``), never the reverse."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = sorted((root / "backends").glob("*.py")) + sorted((root / "mixers").glob("*.py"))
    assert len(files) >= 8
    found = []
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")] + [f"{node.module}.{a.name}" for a in node.names]
            found += [f"{file.name}: {n}" for n in names if any(word in n for word in ("integrations", "models", "transformers"))]
    assert not found, found
