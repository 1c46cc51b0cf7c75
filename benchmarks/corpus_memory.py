"""Memory per rank for the job's data: the token file against the per-rank Python lists it replaced.

For each corpus size, a fresh process builds the job's rows from a JSON-lines corpus (byte-level,
as the embedded model reads ``--data``) and draws 64 rows, while a thread samples its anonymous
memory (RssAnon: what the kernel cannot drop) every 2 ms. It reports that peak and the peak RSS
(sp-bench's ``PeakMemory``: VmHWM reset at the start; it also counts pages mapped from the Arrow
cache and the token file, which the kernel drops when memory is short), both over the process
after its imports. ``before`` runs the
``build_rows`` of commit 1c0fb39 (every rank: load the texts, tokenize into lists, pack into
tensors), taken from git; ``after`` the token file (what one node's first rank runs; the other
ranks only map the file).

    python benchmarks/corpus_memory.py --sizes 23,92,368 --before 23,92
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEFORE = "1c0fb39"
_LINE = json.dumps({"text": "".join(chr(97 + (i * 7) % 26) for i in range(3000))}) + "\n"

_MEASURE = r"""
import json, sys, threading, time, types
import numpy as np
import torch
import ulysses_sp.job.corpus as corpus
from ulysses_sp.cli.bench import PeakMemory

def anon_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))

which, data, warm, cache, old_source = sys.argv[1:6]
cfg = types.SimpleNamespace(seq_len=4096, packing=True, token_cache=cache)
if which == "before":
    source = open(old_source).read().replace("from ..", "from ulysses_sp.").replace("from .config", "from ulysses_sp.job.config")
    old = types.ModuleType("old_corpus")
    exec(compile(source, "old_corpus.py", "exec"), old.__dict__)
    build = lambda path: old.build_rows(path, None, cfg, progress=False)
else:
    build = lambda path: corpus.build_rows(path, None, cfg, progress=False)
build(warm)  # imports and first-use costs before the baseline
base, peak, done = anon_kib(), [0], threading.Event()
def watch():
    while not done.is_set():
        peak[0] = max(peak[0], anon_kib())
        time.sleep(0.002)
threading.Thread(target=watch, daemon=True).start()
with PeakMemory(torch.device("cpu")) as rss:
    start = time.perf_counter()
    rows = build(data)
    seconds = time.perf_counter() - start
    for i in np.random.default_rng(0).integers(0, len(rows), 64):
        rows.batch([int(i)])
done.set()
print(json.dumps({"anon_mib": (max(peak[0], anon_kib()) - base) / 1024, "rss_mib": rss.peak / 2**20, "rows": len(rows), "seconds": seconds}))
"""


def measure(which: str, mib: int, work: str, old_source: str) -> dict:
    data = os.path.join(work, f"corpus{mib}.jsonl")
    if not os.path.exists(data):
        with open(data, "w") as f:
            f.write(_LINE * (mib * 2**20 // len(_LINE)))
    warm = os.path.join(work, "warm.jsonl")
    with open(warm, "w") as f:
        f.write(json.dumps({"text": "warm up"}) + "\n")
    env = {**os.environ, "HF_DATASETS_CACHE": os.path.join(work, f"hf-{which}-{mib}"), "OMP_NUM_THREADS": "1"}  # each converts afresh
    out = subprocess.run([sys.executable, "-c", _MEASURE, which, data, warm, os.path.join(work, f"cache-{which}"), old_source],
                         capture_output=True, text=True, env=env, check=True)
    return {"which": which, "corpus_mib": round(os.path.getsize(data) / 2**20), **json.loads(out.stdout.splitlines()[-1])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="23,92,368", help="corpus sizes in MiB for the token file")
    p.add_argument("--before", default="23,92", help="corpus sizes in MiB for the code before it ('' for none)")
    p.add_argument("--json", default=None, help="also write the rows here")
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        plan = [("before", int(m)) for m in a.before.split(",") if m] + [("after", int(m)) for m in a.sizes.split(",") if m]
        old_source = os.path.join(work, "old_corpus.py")
        if any(which == "before" for which, _ in plan):
            with open(old_source, "w") as f:
                f.write(subprocess.run(["git", "-C", ROOT, "show", f"{BEFORE}:ulysses_sp/job/corpus.py"], capture_output=True, text=True,
                                       check=True).stdout)
        print(f"{'code':<8}{'corpus MiB':>11}{'peak anon MiB':>15}{'peak RSS MiB':>14}{'build s':>9}")
        for which, mib in plan:
            r = measure(which, mib, work, old_source)
            rows.append(r)
            print(f"{which:<8}{r['corpus_mib']:>11}{r['anon_mib']:>15.0f}{r['rss_mib']:>14.0f}{r['seconds']:>9.1f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
