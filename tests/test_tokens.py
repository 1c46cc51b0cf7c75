"""The job's token file (ulysses_sp/job/tokens.py): built once, found again, shared by ranks that
wait for it, its errors raised on every rank, and a corpus much larger than its reader's memory."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("datasets")

from ulysses_sp.job import JobError  # noqa: E402
from ulysses_sp.job.tokens import token_file  # noqa: E402
from ulysses_sp.tasks import EOS_ID  # noqa: E402


def _jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def test_built_once_then_found_by_every_rank(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", ["ab", "c"])
    cache = str(tmp_path / "cache")
    said = []
    built = token_file(data, None, cache, builder=True, say=said.append)
    assert built.tokens.tolist() == [ord("a"), ord("b"), EOS_ID, ord("c"), EOS_ID] and built.ends.tolist() == [3, 5]
    assert any("2 documents, 5 tokens, tokenized into" in line for line in said)
    again = token_file(data, None, cache, builder=False, say=said.append)  # a resumed run, or a rank that waited
    assert again.path == built.path and said[-1] == f"{data}: tokens from {built.path}"
    assert os.listdir(cache) == [os.path.basename(built.path)], "no work folder left behind"
    os.utime(data, ns=(0, 0))  # a changed data file gets a new token file
    assert token_file(data, None, cache, builder=True).path != built.path


def test_a_data_error_reaches_the_ranks_that_wait(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", ["", None])
    cache = str(tmp_path / "cache")
    for builder in (True, False):
        with pytest.raises(JobError, match="no non-empty 'text' records"):
            token_file(data, None, cache, builder=builder)
    (tmp_path / "n.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(JobError, match="no 'text' column"):
        token_file(str(tmp_path / "n.jsonl"), None, cache, builder=True)


def test_a_killed_builders_work_folder_is_removed(tmp_path):
    import socket

    data = _jsonl(tmp_path / "d.jsonl", ["ab"])
    cache = tmp_path / "cache"
    built = token_file(data, None, str(cache), builder=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    stale = cache / f"{os.path.basename(built.path)}.tmp-{socket.gethostname()}-{dead}"
    alive = cache / f"{os.path.basename(built.path)}.tmp-{socket.gethostname()}-{os.getppid()}"
    for folder in (stale, alive):
        folder.mkdir()
    import shutil

    shutil.rmtree(built.path)
    token_file(data, None, str(cache), builder=True)
    assert not stale.exists() and alive.exists(), "only a dead process's folder is removed"


def test_a_tokenizer_gives_the_same_ids_as_calling_it(tmp_path):
    from transformers import AutoTokenizer

    from ulysses_sp.testing.tiny_checkpoint import write_corpus, write_tiny_llama

    write_tiny_llama(str(tmp_path / "model"))
    data = tmp_path / "d.jsonl"
    write_corpus(str(data), 30, seed=3)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "model"))
    texts = [json.loads(line)["text"] for line in data.read_text().splitlines()]
    want = [t for text in texts for t in tok(text)["input_ids"] + [tok.eos_token_id]]
    tf = token_file(str(data), tok, str(tmp_path / "cache"), builder=True)
    assert tf.tokens.tolist() == want and str(tf.tokens.dtype) == "uint16"


_PEAK = textwrap.dedent("""
    import json, sys, threading, time
    import numpy as np
    from ulysses_sp.job.corpus import Rows
    from ulysses_sp.job.tokens import token_file

    def anon_kib():  # memory only this process holds: the mapped files' pages are the kernel's to drop
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))

    data, cache = sys.argv[1], sys.argv[2]
    token_file(sys.argv[3], None, cache, builder=True)  # every import and first-use cost before the baseline
    base, peak, done = anon_kib(), [0], threading.Event()
    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], anon_kib())
            time.sleep(0.002)
    threading.Thread(target=watch, daemon=True).start()
    tf = token_file(data, None, cache, builder=True)
    rows = Rows(tf.tokens, tf.ends, 4096, 0, packing=True)
    for i in np.random.default_rng(0).integers(0, len(rows), 64):
        rows.batch([int(i)])
    done.set()
    print(json.dumps({"peak_kib": max(peak[0], anon_kib()) - base, "tokens": len(tf.tokens)}))
""")


def _peak_anon_kib(tmp_path, documents: int) -> int:
    line = json.dumps({"text": "".join(chr(97 + (i * 7) % 26) for i in range(3000))}) + "\n"
    data = tmp_path / f"corpus{documents}.jsonl"
    with open(data, "w") as f:
        f.write(line * documents)
    small = _jsonl(tmp_path / "small.jsonl", ["warm up"])
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _PEAK, str(data), str(tmp_path / "cache"), small], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["tokens"] == documents * 3001
    print(f"corpus {os.path.getsize(data) / 2**20:.0f} MiB: peak anonymous memory +{result['peak_kib'] / 1024:.0f} MiB")
    return result["peak_kib"]


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the process's anonymous memory from Linux's /proc")
def test_a_corpus_far_larger_than_the_memory_it_takes(tmp_path):
    """Peak anonymous memory while tokenizing a corpus and drawing rows from it, at 23 and 92 MiB:
    it does not grow with the corpus (the Python lists this replaced took about 10 bytes per byte
    of text; what remains is datasets' fixed conversion buffers), so a corpus 10x a rank's memory
    share tokenizes and trains. The pages mapped from disk (Arrow, the token file) are not
    counted: the kernel drops them when memory is short. benchmarks/corpus_memory.py measures
    both at larger sizes, and the code it replaced."""
    small, large = _peak_anon_kib(tmp_path, 8_000), _peak_anon_kib(tmp_path, 32_000)
    grew = (large - small) * 1024
    assert grew < 69 * 2**20 / 4, f"4x the corpus took {grew >> 20} MiB more anonymous memory"
