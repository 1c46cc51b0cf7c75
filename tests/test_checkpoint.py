"""The job's crash-safe checkpoints (``ulysses_sp.job.checkpoint``) on the file system alone: what
a kill at each point of a save leaves, what a resume takes, what rotation deletes, and the
metrics file across resumes. The job around them: tests/test_train_real.py."""

import json
import os
from types import SimpleNamespace

import pytest

from ulysses_sp.job import checkpoint
from ulysses_sp.job.metrics import MetricsFile


def _written(directory, step, run="r1", files=None):
    """What every rank leaves before rank 0 finishes: the partial tag with its files."""
    root = directory / checkpoint.partial_tag(step)
    (root / "global").mkdir(parents=True, exist_ok=True)
    for name, size in (files or {"global/model_states.pt": 100, "rng_state_rank0.pt": 10}).items():
        (root / name).write_bytes(b"x" * size)
    return checkpoint.finish(str(directory), step, {"run": run, "resume": {"seq_len": 64}})


@pytest.mark.quick
def test_a_finished_save_is_complete_and_named_by_latest(tmp_path):
    assert _written(tmp_path, 3) == "step3"
    assert (tmp_path / "latest").read_text() == "step3"
    manifest, why = checkpoint.inspect(str(tmp_path), "step3")
    assert why is None and manifest["step"] == 3 and manifest["files"] == {"global/model_states.pt": 100, "rng_state_rank0.pt": 10}
    assert manifest["run"] == "r1" and manifest["resume"] == {"seq_len": 64}
    assert not list(tmp_path.glob(".partial*")) and not list(tmp_path.glob("*.tmp"))


def test_an_existing_tag_is_never_overwritten(tmp_path):
    """A re-run saving a step a crashed run also saved: a new tag, the old one untouched."""
    _written(tmp_path, 4)
    before = (tmp_path / "step4" / checkpoint.MANIFEST).read_text()
    assert _written(tmp_path, 4, run="r2") == "step4.1" and _written(tmp_path, 4, run="r2") == "step4.2"
    assert (tmp_path / "step4" / checkpoint.MANIFEST).read_text() == before
    assert (tmp_path / "latest").read_text() == "step4.2"


@pytest.mark.parametrize("damage,why", [
    (lambda d: (d / "step5" / "global" / "model_states.pt").write_bytes(b"x" * 7), "global/model_states.pt has 7 bytes, the manifest says 100"),
    (lambda d: os.remove(d / "step5" / "rng_state_rank0.pt"), "rng_state_rank0.pt is missing"),
    (lambda d: os.remove(d / "step5" / checkpoint.MANIFEST), "no manifest"),
    (lambda d: (d / "step5" / checkpoint.MANIFEST).write_text("{cut"), "unreadable manifest"),
    (lambda d: (d / "step5" / "global" / "extra.pt").write_bytes(b"x"), "global/extra.pt is not in the manifest"),
])
def test_resume_takes_the_newest_intact_checkpoint_and_says_what_it_skipped(tmp_path, damage, why):
    _written(tmp_path, 3)
    _written(tmp_path, 5)
    damage(tmp_path)
    (tmp_path / checkpoint.partial_tag(7) / "global").mkdir(parents=True)  # a save killed before rank 0 finished it
    tag, manifest, skipped = checkpoint.find_resumable(str(tmp_path))
    assert (tag, manifest["step"]) == ("step3", 3)
    assert len(skipped) == 2 and skipped[0].startswith("step5: " + why), skipped
    assert skipped[1].startswith("step5 (named by latest): " + why), skipped


def test_nothing_to_resume(tmp_path):
    assert checkpoint.find_resumable(str(tmp_path / "none")) == (None, None, [])
    (tmp_path / checkpoint.partial_tag(1)).mkdir()
    assert checkpoint.find_resumable(str(tmp_path)) == (None, None, [])


def test_rotation_keeps_the_newest_of_this_run_and_never_what_latest_names(tmp_path):
    for step in (1, 2, 3):
        _written(tmp_path, step)
    _written(tmp_path, 9, run="other")  # another run's (higher-numbered) checkpoint: not ours to delete
    (tmp_path / "step8").mkdir()  # a torn leftover: not counted as ours, not deleted
    (tmp_path / "latest").write_text("step1")
    assert checkpoint.rotate(str(tmp_path), 1, "r1", {"step3"}) == []
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step")) == ["step1", "step3", "step8", "step9"]


def test_rotation_reports_what_it_could_not_delete(tmp_path, monkeypatch):
    for step in (1, 2):
        _written(tmp_path, step)
    import shutil

    def failing(path, **kw):
        (kw.get("onexc") or kw.get("onerror"))(os.remove, path, PermissionError("read-only") if "onexc" in kw else (None, PermissionError("read-only"), None))

    monkeypatch.setattr(shutil, "rmtree", failing)
    assert checkpoint.rotate(str(tmp_path), 1, "r1", {"step2"}) == [f"could not delete checkpoint step1: {tmp_path / 'step1'}: read-only"]


def test_resume_mismatches_name_every_changed_setting_and_steps_may_grow():
    saved = {"seq_len": 64, "steps": 10, "seed": 0}
    assert checkpoint.resume_mismatches(saved, dict(saved)) == []
    assert checkpoint.resume_mismatches(saved, {"seq_len": 128, "steps": 10, "seed": 1}) == ["seq_len: checkpoint 64, now 128", "seed: checkpoint 0, now 1"]
    assert checkpoint.resume_mismatches(saved, {**saved, "steps": 12}) == []
    assert checkpoint.resume_mismatches(saved, {**saved, "steps": 8}) == ["steps: checkpoint 10, now 8"]


def test_existing_lists_checkpoints_complete_or_not(tmp_path):
    assert checkpoint.existing(str(tmp_path / "none")) == [] == checkpoint.existing(str(tmp_path))
    (tmp_path / checkpoint.partial_tag(1)).mkdir()  # a save killed before its first rename: not a checkpoint
    assert checkpoint.existing(str(tmp_path)) == []
    (tmp_path / "step2").mkdir()
    _written(tmp_path, 3)
    assert checkpoint.existing(str(tmp_path)) == ["step2", "step3", "latest"]


def test_metrics_file_starts_anew_or_keeps_the_steps_through_the_checkpoint(tmp_path):
    path = str(tmp_path / "m.jsonl")
    first = MetricsFile(path, True)
    for step in (1, 2, 3):
        first.write(step=step, loss=float(step))
    first.write(step=3, eval_loss=0.5)
    with open(path, "a") as f:
        f.write('{"step": 4, "lo')  # cut by a crash
    MetricsFile(path, True, keep_through=2).write(step=3, loss=float("nan"))
    lines = [json.loads(line) for line in open(path)]
    assert [(r["step"], r.get("loss")) for r in lines] == [(1, 1.0), (2, 2.0), (3, None)]  # NaN as null: strict JSON
    previous = open(path).read()
    MetricsFile(path, True)  # a fresh run: the old file moved aside
    assert open(path).read() == "" and open(f"{path}.1").read() == previous
    MetricsFile(path, True)  # nothing to move aside: an empty file
    assert not os.path.exists(f"{path}.2")
    MetricsFile(path, False).write(step=1)  # not rank 0: untouched
    assert open(path).read() == ""


def test_the_ranks_wait_for_rank_0s_file_work_on_their_own_group(tmp_path, monkeypatch):
    """Job.save: the waits around what rank 0 alone does (clearing a crashed save, then flushing,
    renaming and rotating) are on the job's gloo io_group (--io-timeout), not the training
    collectives' --dist-timeout; the wait for every rank's own files stays on the world."""
    from ulysses_sp.job import run

    calls = []
    monkeypatch.setattr(run.dist, "barrier", lambda group=None: calls.append(("barrier", group)))
    monkeypatch.setattr(run.comm, "broadcast_object", lambda obj, src, group: calls.append(("broadcast", group)) or obj)

    class Engine:
        def save_checkpoint(self, directory, tag, client_state, save_latest):
            os.makedirs(os.path.join(directory, tag, "global"))
            with open(os.path.join(directory, tag, "global", "model_states.pt"), "wb") as f:
                f.write(b"x" * 10)

    job = SimpleNamespace(cfg=SimpleNamespace(save=str(tmp_path), keep_last=2), rank0=True, engine=Engine(), topo=SimpleNamespace(rank=0),
                          run="r1", resume_state={}, io_group="io")
    run.Job.save(job, 3)
    assert calls == [("barrier", "io"), ("barrier", None), ("broadcast", "io")]
    assert job.last_checkpoint == str(tmp_path / "step3") and checkpoint.inspect(str(tmp_path), "step3")[1] is None


def test_rng_states_round_trip_without_unpickling_and_a_pickle_is_refused(tmp_path):
    """save_rng writes tensors and plain values only: load_rng reads them with weights_only=True and
    restores every stream; a file holding another object (what a hostile checkpoint would plant) is
    refused by name, and its code never runs."""
    import pickle
    import random

    import numpy
    import torch

    (tmp_path / checkpoint.partial_tag(1)).mkdir()
    torch.manual_seed(3), random.seed(3), numpy.random.seed(3)
    checkpoint.save_rng(str(tmp_path), 1, 0)
    want = (torch.rand(3), random.random(), numpy.random.rand())
    torch.manual_seed(4), random.seed(4), numpy.random.seed(4)
    assert checkpoint.load_rng(str(tmp_path), checkpoint.partial_tag(1), 0)
    got = (torch.rand(3), random.random(), numpy.random.rand())
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]
    torch.load(tmp_path / checkpoint.partial_tag(1) / "rng_state_rank0.pt", weights_only=True)  # raises on anything else

    class Planted:
        def __reduce__(self):
            return (print, ("code ran",))

    (tmp_path / "bad").mkdir()
    with open(tmp_path / "bad" / "rng_state_rank0.pt", "wb") as f:
        pickle.dump({"torch": Planted()}, f, protocol=2)
    with pytest.raises(ValueError, match="refuses to unpickle"):
        checkpoint.load_rng(str(tmp_path), "bad", 0)
