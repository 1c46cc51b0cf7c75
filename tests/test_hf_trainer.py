"""SequenceParallelTrainer on 2 ranks against transformers.Trainer on one process.

Every SP case of tests/hf_trainer_cases.py runs in ONE call on the session's pool of 2 ranks, the
one-process references on the 1-rank pool, side by side. Tiny Llama, Qwen2 (packed) and Qwen2.5-VL (an image in
every sample, through a collator of Qwen's patches) are built in code;
fp32, 8 optimizer steps of 2 accumulated micro-batches, under DDP (also compiled: torch_compile=True), accelerate's FSDP2 and DeepSpeed ZeRO-2 and ZeRO-3, plain SGD without clipping (a gradient off
by a constant factor shows; Adam would hide it). Three negative controls (num_items_in_batch
counted on every SP rank; DDP's and FSDP2's averages left unscaled) prove the comparisons can fail.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

_MISSING = [m for m in ("transformers", "accelerate", "peft", "deepspeed") if importlib.util.find_spec(m) is None]
# find_spec, not importorskip: the work runs in spawned processes, importing these here only costs time
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"not installed: {', '.join(_MISSING)} (extras hf, peft, deepspeed)")

from .conftest import free_port, pool_results, warm_python  # noqa: E402
from .hf_trainer_cases import SP_CASES, STEPS, run_references, run_sp_cases  # noqa: E402

LOSS_TOL, EVAL_TOL = 1e-4, 1e-5
EXACT = [name for name, (_, case) in SP_CASES.items() if not case.get("overcount") and not case.get("unscaled")]
ROOT = Path(__file__).resolve().parents[1]


def _calls() -> list:
    """The one-process references on the 1-rank pool and every SP case in one call on the 2-rank pool."""
    return [(1, run_references, (sorted({ref for ref, _ in SP_CASES.values()}),), 300), (2, run_sp_cases, (list(SP_CASES),), 300)]


def pool_calls(items) -> list:
    """``_calls`` if a selected test reads them (tests/conftest.py queues them behind the cases)."""
    return _calls() if any("runs" in item.fixturenames for item in items) else []


@pytest.fixture(scope="module")
def runs(pool):
    """(reference results by name, [SP results by case name] per rank); both pools at once."""
    ref, sp = pool_results(pool, _calls())
    return ref[0], sp


def _ok(result, what):
    if not result["ok"]:
        pytest.fail(f"{what} raised:\n{result['error']}")
    return result["value"]


def _pair(runs, name):
    """(the one-process reference, [each rank's SP result]) for case ``name``."""
    refs, ranks = runs
    ref_name = SP_CASES[name][0]
    return _ok(refs[ref_name], f"reference {ref_name}"), [_ok(r[name], f"case {name} on rank {i}") for i, r in enumerate(ranks)]


@pytest.mark.parametrize("name", EXACT)
def test_loss_per_step_equals_one_process(runs, name):
    ref, ranks = _pair(runs, name)
    assert len(ref["losses"]) == STEPS
    if "lora" not in name:  # the adapters' own progress is checked in test_lora_on_q_and_v_with_k_frozen
        fall = SP_CASES[name][1].get("learns", 0.25)
        assert ref["losses"][-1] < ref["losses"][0] - fall, f"the reference must learn, else equal curves prove little: {ref['losses']}"
    for rank, r in enumerate(ranks):
        assert r["deepspeed"] == ("zero" in name), "only the DeepSpeed cases run under DeepSpeed"
        worst = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
        assert len(r["losses"]) == STEPS and worst < LOSS_TOL, f"rank {rank}: {r['losses']} vs one process {ref['losses']}"


@pytest.mark.parametrize("name", EXACT)
def test_eval_loss_equals_one_process(runs, name):
    """eval_loss is the mean over the eval set's target tokens, computed one sample at a time on
    one process. 5 eval samples in batches of 2: a short last batch; at DP=2 one group runs a
    padding batch. The samples hold different numbers of targets, so transformers' mean of batch
    means differs: the comparison would catch a batch weighted by its samples."""
    ref, ranks = _pair(runs, name)
    assert abs(ref["eval_loss_tokens"] - ref["eval_loss"]) > 10 * EVAL_TOL, "the data must tell the two weightings apart"
    for r in ranks:
        assert abs(r["eval_loss"] - ref["eval_loss_tokens"]) < EVAL_TOL, (r["eval_loss"], ref["eval_loss_tokens"])


def test_batches_without_targets_do_not_move_eval_loss(runs):
    """Three more samples without any target (a batch with none, one with one target sample):
    eval_loss stays the mean over the same target tokens. transformers counts such a batch as a
    loss of NaN, the per-sample weighting this replaced as 0."""
    ref, ranks = _pair(runs, "llama/sp2")
    for r in ranks:
        assert abs(r["eval_loss_without_targets"] - ref["eval_loss_tokens"]) < EVAL_TOL, (r["eval_loss_without_targets"], ref["eval_loss_tokens"])


def test_the_default_layout_is_balanced_for_packed_rows(runs):
    """sp_layout="auto" (the default): balanced for the packed dataset (position ids restarting at
    0), zigzag for rows of one document; an explicit layout is kept. The loss tests above show
    each exact."""
    expected = {"qwen2-packed/sp2/ring": "balanced", "qwen2-packed/sp2/ring/zigzag": "zigzag", "llama/sp2": "zigzag"}
    for name, layout in expected.items():
        assert [r["layout"] for r in _pair(runs, name)[1]] == [layout, layout], name


@pytest.mark.parametrize("name,least", [("llama/sp2/overcount", 1.0), ("llama/sp2/unscaled", 0.05), ("llama/sp2/fsdp2/unscaled", 0.05)])
def test_the_comparison_can_fail(runs, name, least):
    """num_items_in_batch counted per SP rank (transformers' cross-device count) halves the loss;
    DDP's or FSDP2's world average left unscaled halves the step: all far outside the tolerance."""
    ref, ranks = _pair(runs, name)
    worst = max(abs(a - b) for a, b in zip(ranks[0]["losses"], ref["losses"]))
    assert worst > least, (ranks[0]["losses"], ref["losses"])


def test_fsdp2_shards_the_model(runs):
    """The FSDP2 cases ran under accelerate's fully_shard (forced on CPU: accelerate enables FSDP on
    GPUs only), the DDP case did not; test_loss_per_step_equals_one_process covers their losses."""
    for name, sharded in (("llama/sp2/fsdp2", True), ("llama/sp2/fsdp2/unscaled", True), ("llama/sp2", False)):
        assert [r["fsdp2"] for r in _pair(runs, name)[1]] == [sharded, sharded], name


def test_predict_gathers_logits_in_global_order(runs):
    ref, ranks = _pair(runs, "llama/sp2")
    expected = np.asarray(ref["logits"])
    assert expected.shape == (5, 45, 64)
    for r in ranks:
        assert r["logits"].shape == expected.shape
        assert np.abs(r["logits"] - expected).max() < 1e-4
        assert (r["argmax"] == expected.argmax(-1)).all()
        assert "sp_predict_logits='none'" in r["no_logits_error"] and "GiB" in r["no_logits_error"]


def test_generate_after_remove_sequence_parallel(runs):
    ref, ranks = _pair(runs, "llama/sp2")
    for r in ranks:
        assert r["generated"] == ref["generated"]
        assert "remove_sequence_parallel was called" in r["eval_after_remove"]


def test_lora_on_q_and_v_with_k_frozen(runs):
    """Layer 0's k needs no gradient (frozen projection of the frozen embedding): the situation of
    the Fast-LLM crash. Training is exact (above, with ulysses and ring); the adapter
    saved by rank 0 and loaded into a fresh base model gives the trained model's logits."""
    _, ranks = _pair(runs, "llama-lora/sp2")
    for r in ranks:
        assert r["k_needs_grad"] == [(0, False), (1, True)]
        assert r["trainable"] and all("lora_" in n and ("q_proj" in n or "v_proj" in n) for n in r["trainable"])
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(r["saved_files"])
        assert r["lora_moved"] > 1e-3 and r["reload_err"] < 1e-6


def test_auto_avoids_ulysses_for_three_heads(runs):
    _, ranks = _pair(runs, "llama-3heads/sp2/auto")
    assert all("ulysses" not in r["chosen"] and r["chosen"] for r in ranks)


def test_bad_input_raises_on_every_rank_before_any_collective(runs):
    """A collective would hang the group (the deadline would fail the test instead)."""
    messages = [_ok(r["errors"], f"error cases on rank {i}") for i, r in enumerate(runs[1])]
    for m in messages:
        assert m["sp3_on_2"].startswith("ValueError: sp_size (3) must divide the world size (2)")
        assert "q heads (3) must divide by the all-to-all degree (2)" in m["ulysses_3_heads"] and "auto" in m["ulysses_3_heads"]
        assert "one name per attention layer (2), got 3" in m["layers_list"]
        assert "unknown SP backend 'rong'" in m["unknown_backend"]
        assert "sp_predict_logits must be one of" in m["bad_predict_mode"]
        assert m["bloom"].startswith("ValueError: BloomForCausalLM cannot run under sequence parallelism") and "BloomAttention (layer 1" in m["bloom"]
        assert "not supported: FSDP1 (fsdp_config version 1; FSDP2, the default, is)" in m["fsdp1"], m["fsdp1"]
        passed, layers, worst = m["sp_verify"]
        assert passed and layers == 2 and worst < 1e-12, m["sp_verify"]


@pytest.mark.quick
def test_hf_argument_parser_gets_the_sp_flags():
    from transformers import HfArgumentParser

    from ulysses_sp.integrations.trainer import SequenceParallelTrainingArguments

    (args,) = HfArgumentParser(SequenceParallelTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "x", "--sp_size", "4", "--sp_backend", "ring,halo", "--ulysses_degree", "2", "--tiled_loss",
         "--sp_checkpoint", "layers", "--sp_predict_logits", "argmax", "--report_to", "none"])
    assert (args.sp_size, args.sp_backend, args.ulysses_degree, args.tiled_loss, args.tiled_mlp) == (4, "ring,halo", 2, True, False)
    assert (args.sp_checkpoint, args.sp_predict_logits) == ("layers", "argmax")
    with pytest.raises(ValueError, match="ulysses_degree \\(3\\) must divide sp_size \\(4\\)"):
        SequenceParallelTrainingArguments(output_dir="x", sp_size=4, ulysses_degree=3, report_to=[])


def _example_args(tmp_path, name: str, *extra: str) -> list[str]:
    return [str(ROOT / "examples" / "train_with_trainer.py"), "--use_cpu", "--output_dir", str(tmp_path / name), "--max_steps", "4",
            "--learning_rate", "1e-2", "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true",
            "--seq_len", "64", "--train_samples", "32", "--results", str(tmp_path / f"{name}.json"), *extra]


EXAMPLE_ENV = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}


def _example(launcher: list[str], tmp_path, name: str, *extra: str) -> subprocess.Popen:
    proc = subprocess.Popen([*launcher, *_example_args(tmp_path, name, *extra)], cwd=tmp_path, env={**os.environ, **EXAMPLE_ENV},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc.result_path = tmp_path / f"{name}.json"
    return proc


def _finished(proc) -> dict:
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-4000:]
    return json.loads(proc.result_path.read_text())


def test_example_under_every_launcher_equals_one_process(tmp_path):
    """examples/train_with_trainer.py with SP=2 on 2 CPU ranks under torchrun, accelerate launch
    (--multi_gpu: its --cpu needs mpirun for several processes) and the deepspeed launcher (with
    --deepspeed examples/ds_zero2.json) trains as the same script on one process."""
    bin_dir = Path(sys.executable).parent
    launchers = {
        "torchrun": ([str(bin_dir / "torchrun"), "--standalone", "--nproc_per_node", "2"], ()),
        "accelerate": ([str(bin_dir / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                        "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port())], ()),
        "deepspeed": ([str(bin_dir / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port())],
                      ("--deepspeed", str(ROOT / "examples" / "ds_zero2.json"))),
    }
    # the script alone as `python examples/train_with_trainer.py` runs it, without a new interpreter's imports
    single = warm_python(_example_args(tmp_path, "single", "--sp_size", "1"), env={**os.environ, **EXAMPLE_ENV}, cwd=tmp_path,
                         log=tmp_path / "single.log")
    procs = {name: _example(cmd, tmp_path, name, "--sp_size", "2", *extra) for name, (cmd, extra) in launchers.items()}
    results = {name: _finished(p) for name, p in procs.items()}  # all at once: their imports overlap
    single.join(600)
    assert single.exitcode == 0, (tmp_path / "single.log").read_text()[-4000:]
    one = json.loads((tmp_path / "single.json").read_text())
    assert one["world"] == 1 and len(one["losses"]) == 4 and one["losses"][-1] < one["losses"][0]
    for name, r in results.items():
        assert (r["world"], r["sp_size"]) == (2, 2), name
        assert max(abs(a - b) for a, b in zip(r["losses"], one["losses"])) < LOSS_TOL, (name, r["losses"], one["losses"])
        assert abs(r["eval_loss"] - one["eval_loss"]) < EVAL_TOL, name
        assert r["generated"] == one["generated"], name


@pytest.mark.quick
def test_auto_layout_reads_the_collator_and_the_first_example():
    from transformers import DataCollatorWithFlattening

    from ulysses_sp.integrations.trainer import _auto_layout

    assert _auto_layout(None, DataCollatorWithFlattening()) == "balanced"
    assert _auto_layout([{"input_ids": [5, 6, 7], "position_ids": [0, 1, 0]}], None) == "balanced"
    assert _auto_layout([{"input_ids": [5, 6, 7], "position_ids": [0, 1, 2]}], None) == "zigzag"
    assert _auto_layout([{"input_ids": [5, 6, 7]}], None) == "zigzag"
    assert _auto_layout(None, None) == "zigzag"
