"""The quick slice (``python -m pytest -m quick``) stands for the whole suite: it holds a test of every
backend, layout, mixer strategy, model family and integration module.

What must be covered is read from the code (the backends/, mixers/, integrations/ and models/ folders, the
layouts, tests/model_families.py), so a new one fails here until a quick test stands for it; what is
covered is read from the ``quick`` markers of the collected tests (tests/conftest.py).
"""

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from ulysses_sp.layout import LAYOUTS

from .conftest import QUICK
from .model_families import EXACT, HYBRID

ROOT = Path(__file__).resolve().parents[1]
TESTS = sorted(p.name for p in (ROOT / "tests").glob("test_*.py"))


def _modules(folder: str) -> list[str]:
    return sorted(p.stem for p in (ROOT / folder).glob("*.py") if not p.stem.startswith("_") and p.stem != "common")


@pytest.fixture(scope="module")
def quick(request) -> dict:
    """The quick slice's node ids and each one's test function source (what it names)."""
    seen = request.config.stash.get(QUICK, {})
    if {nodeid.split("::")[0].split("/")[-1] for nodeid in seen} >= set(TESTS):
        ids = [nodeid for nodeid, is_quick in seen.items() if is_quick]
    else:  # this session collected part of the suite: collect the whole for the slice
        done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "quick", "-p", "no:cacheprovider"], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        ids = [line for line in done.stdout.splitlines() if "::" in line]
    sources = {}
    for nodeid in [i for i in ids if not i.split("::")[0].endswith("test_quick.py")]:  # not these checks' own ids
        path, name = nodeid.split("::")[0], nodeid.split("::")[-1].split("[")[0]
        module = sys.modules.get(f"tests.{Path(path).stem}") or __import__(f"tests.{Path(path).stem}", fromlist=["_"])
        sources[nodeid] = inspect.getsource(getattr(module, name))
    return sources


@pytest.mark.quick
@pytest.mark.parametrize("kind,names", [
    ("backend", [*_modules("backends"), "auto", "ulysses-g2"]),
    ("layout", list(LAYOUTS)),
    ("mixer strategy", _modules("mixers")),
    ("model family", [*EXACT, *HYBRID]),
])
def test_every_backend_layout_mixer_and_family_has_a_quick_case(quick, kind, names):
    """Named in a quick test's parameters (its node id), e.g. ``test_matches_one_process_reference[P2-ring/balanced-causal-gqa]``."""
    ids = "\n".join(quick)
    missing = [n for n in names if not any(f"{sep}{n}{end}" in ids for sep in "[/-_" for end in "/-]_")]
    assert not missing, f"no quick test names the {kind}(s) {missing}"


@pytest.mark.quick
@pytest.mark.parametrize("folder,module", [(folder, m) for folder in ("integrations", "models", "models/adapters")
                                           for m in _modules(f"ulysses_sp/{folder}")])
def test_every_integration_and_model_module_has_a_quick_test(quick, folder, module):
    """Named by a quick test's node id or its source (an import, or its docstring naming the module)."""
    dotted = folder.replace("/", ".")
    named = [nodeid for nodeid, source in quick.items() if module in nodeid or f"{dotted}.{module}" in source
             or f"{folder}/{module}.py" in source]
    assert named, f"no quick test names ulysses_sp/{folder}/{module}.py"
