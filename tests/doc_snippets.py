"""The Python blocks of README.md and the docs pages, as tests/test_docs.py runs them.

A page marks how each ```` ```python ```` block runs with an HTML comment on the line just before it
(the rendered page does not show it):

* no comment: the block runs as it stands in one process (a pool of one gloo rank);
* ``<!-- run: ranks=2 -->``: on each rank of a pool of that many gloo ranks, like ``torchrun
  --nproc_per_node 2``. The pool's process group is already up, so ``dist.init_process_group``
  and ``dist.destroy_process_group`` are no-ops inside a block;
* ``setup=NAME`` (``<!-- run: ranks=2 setup=hf_llama -->``): ``SETUPS[NAME]`` runs first, defining
  what the block takes as given (a tiny model, a batch); the page says what those are;
* ``continues``: the block runs after the page's previous block, in its namespace (the same run);
* ``<!-- not run: REASON -->``: not run; the reason is required and is the page's to state (a GPU,
  a downloaded model, minutes of training).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

SETUPS = {
    # a tiny random-init Llama (2 layers, 4 query and 2 KV heads), `config`, `model`, and `batch`:
    # one row of 64 random token ids and its labels, the same on every rank
    "hf_llama": """
import torch
import torch.distributed as dist
import transformers
import ulysses_sp as usp
torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
ids = torch.randint(0, 128, (1, 64))
batch = {"input_ids": ids, "labels": ids.clone()}
topo = usp.init_sequence_parallel(sp_size=dist.get_world_size())
""",
}

_MARK = re.compile(r"<!--\s*(run|not run):?\s*(.*?)\s*-->\s*$")


@dataclass
class Run:
    """One run of a page: its first block's marks and the text of it and every block that continues it."""

    page: str
    line: int
    ranks: int = 1
    setup: str | None = None
    skip: str | None = None
    blocks: list = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def source(self) -> str:
        return "\n".join(([SETUPS[self.setup]] if self.setup else []) + self.blocks)


def runs(path: Path) -> list[Run]:
    """Every run of the page's Python blocks, in page order; a malformed mark raises, naming its line."""
    lines, found, i = path.read_text(encoding="utf-8").splitlines(), [], 0
    page = str(path.relative_to(ROOT))
    while i < len(lines):
        if lines[i].strip() != "```python":
            i += 1
            continue
        start, mark = i + 1, _MARK.match(lines[i - 1].strip()) if i else None
        end = next(j for j in range(start, len(lines)) if lines[j].strip() == "```")
        indent = len(lines[i]) - len(lines[i].lstrip())
        text = "\n".join(line[indent:] for line in lines[start:end])
        options = dict(ranks=1, setup=None, continues=False)
        if mark and mark.group(1) == "not run":
            if not mark.group(2):
                raise ValueError(f"{page}:{start}: `not run` needs a reason: <!-- not run: REASON -->")
            found.append(Run(page, start, skip=mark.group(2), blocks=[text]))
        else:
            for word in (mark.group(2).split() if mark else []):
                key, _, value = word.partition("=")
                if key == "ranks" and value.isdigit():
                    options["ranks"] = int(value)
                elif key == "setup" and value in SETUPS:
                    options["setup"] = value
                elif key == "continues" and not value:
                    options["continues"] = True
                else:
                    raise ValueError(f"{page}:{start}: unknown mark {word!r} (ranks=N, setup={'|'.join(SETUPS)}, continues)")
            if options["continues"]:
                if not found or found[-1].skip:
                    raise ValueError(f"{page}:{start}: `continues` follows no run block")
                found[-1].blocks.append(text)
            else:
                found.append(Run(page, start, ranks=options["ranks"], setup=options["setup"], blocks=[text]))
        i = end + 1
    return found


def run_block(rank: int, world: int, source: str, name: str) -> None:
    """A pool rank's run of one block: the process group is the pool's, so the block's own
    ``init_process_group`` and ``destroy_process_group`` are no-ops."""
    import torch.distributed as dist

    saved = dist.init_process_group, dist.destroy_process_group
    dist.init_process_group = lambda *a, **k: None
    dist.destroy_process_group = lambda *a, **k: None
    try:
        exec(compile(source, name, "exec"), {"__name__": "__main__"})
    finally:
        dist.init_process_group, dist.destroy_process_group = saved
