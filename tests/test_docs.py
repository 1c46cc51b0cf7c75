"""The docs are tested: the site builds with ``mkdocs build --strict``, and every Python block of
README.md and the docs pages runs (tests/doc_snippets.py says how a page marks a block)."""

import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import started_early
from .doc_snippets import PAGES, ROOT, run_block, runs

RUNS = [run for page in PAGES for run in runs(page)]


@pytest.mark.quick
def test_every_python_block_runs_or_says_why_not():
    """Every block is a run (the test below) or marked ``not run`` with its reason; the marks parse."""
    assert RUNS, "no Python block found"
    for run in RUNS:
        assert not run.skip or len(run.skip.split()) >= 2, f"{run.id}: say why it is not run ({run.skip!r})"


@pytest.mark.parametrize("run", [r for r in RUNS if not r.skip], ids=lambda r: r.id)
def test_python_block_runs(pool, run):
    pool(run.ranks).run(run_block, run.source, run.id, timeout=600)


def _build_site(tmp_path):
    return subprocess.Popen([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.mark.quick
@started_early(_build_site)
def test_site_builds_strict(early):
    """Broken links, pages missing from the nav, and references mkdocstrings cannot resolve fail it."""
    _, stderr = early.communicate(timeout=600)
    assert early.returncode == 0, stderr[-6000:]
    assert (Path(early.args[-1]) / "index.html").exists()


@pytest.mark.quick
def test_supported_models_page_is_generated():
    """docs/models.md is what ``benchmarks/support_table.py --page`` makes from the stored run, and
    that run covers every family of tests/model_families.py at each of its rank counts."""
    import importlib.util
    import json

    from .model_families import FAMILIES

    spec = importlib.util.spec_from_file_location("support_table", ROOT / "benchmarks" / "support_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    data = json.loads((ROOT / "benchmarks" / "results" / "support-table.json").read_text())
    assert (ROOT / "docs" / "models.md").read_text() == table.render(data), "run: python benchmarks/support_table.py --page"
    for world, cells in data["results"].items():
        assert set(cells) == set(FAMILIES), f"P={world}: the stored run lacks {sorted(set(FAMILIES) - set(cells))}; rerun the script"


@pytest.mark.quick
def test_quick_start_commands_are_the_ones_ci_runs():
    """The shell commands of README.md's quick start, and of the getting-started page's, are the
    two that .ci/run checks and runs."""
    import re
    import shlex

    ci = (ROOT / ".ci" / "run").read_text()
    ran = {shlex.split(line.split("=", 1)[1])[0] for line in ci.splitlines() if re.match(r"(TEST|JOB)_CMD=", line)}
    assert len(ran) == 2, ran
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert set(re.findall(r"```bash\n\s*(.+?)\n\s*```", quick)) == ran
    page = (ROOT / "docs" / "getting-started.md").read_text().split("## The quick start", 1)[1].split("\n## ", 1)[0]
    assert set(re.findall(r"```bash\n\s*(.+?)\n\s*```", page)) == ran


@pytest.mark.quick
def test_pages_stay_digests_and_name_every_benchmark_script():
    """README.md at most 200 lines, the architecture map at most 500; every script in benchmarks/
    named on the benchmarks page (which gives the table it makes)."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
    assert len((ROOT / "docs" / "architecture.md").read_text().splitlines()) <= 500
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    scripts = sorted(p.name for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh"))
    assert scripts and not [s for s in scripts if s not in page], "name each benchmarks/ script on docs/benchmarks.md"
