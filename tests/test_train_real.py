"""The main job on a real model directory and real files, on 2 ranks against one process:
a DeepSpeed config with accumulation (exact), packing, bf16, eval, save-every then resume,
and the Hugging Face export. A tiny Llama and a word-level tokenizer trained here stand in
for a downloaded model; each world size runs several jobs in one call on the session's pool of ranks."""

import functools
import json
import math
import os

import pytest
import torch

pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
pytest.importorskip("transformers", reason="the hf extra is not installed")
pytest.importorskip("datasets", reason="the hf extra is not installed")

from ulysses_sp.testing.tiny_checkpoint import IMAGE_TOKENS, write_corpus, write_image_corpus, write_tiny_llama, write_tiny_vlm  # noqa: E402

from .conftest import pool_results  # noqa: E402

SEQ, STEPS = 128, 6
PROCESSED = ("gemma3", "llava_next", "idefics3")
"""Image-text families trained through the job from their processors' outputs, beside LLaVA's (`_vlm_job`)."""
def _make_files(root: str) -> dict:
    """A model directory (config, weights, tokenizer), train/eval JSON lines and DeepSpeed configs."""
    files = {"model": os.path.join(root, "model"), "train": os.path.join(root, "train.jsonl"), "eval": os.path.join(root, "eval.jsonl"),
             "tokens": os.path.join(root, "tokens")}
    write_tiny_llama(files["model"])
    write_corpus(files["train"], 40, seed=0)
    write_corpus(files["eval"], 7, seed=1)
    files.update(vlm=os.path.join(root, "vlm"), vlm_train=os.path.join(root, "vlm_train.jsonl"), vlm_eval=os.path.join(root, "vlm_eval.jsonl"))
    write_tiny_vlm(files["vlm"])
    write_image_corpus(files["vlm_train"], 24, seed=0)
    write_image_corpus(files["vlm_eval"], 4, seed=1)
    for family in PROCESSED:
        files.update({family: os.path.join(root, family), f"{family}_train": os.path.join(root, f"{family}_train.jsonl")})
        write_tiny_vlm(files[family], family)
        write_image_corpus(files[f"{family}_train"], 24, seed=0, image_dir=f"{family}_images", image_token=IMAGE_TOKENS[family],
                           varied=family != "gemma3")
    for name, extra in (("fp32", {}), ("bf16", {"bf16": {"enabled": True}}), ("zero3", {"zero_optimization": {"stage": 3}})):
        files[name] = os.path.join(root, f"ds_{name}.json")
        with open(files[name], "w") as f:
            json.dump({"gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2}, **extra,
                       "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.0, "torch_adam": True}}}, f)
    return files


def _cfg(files, **overrides):
    from ulysses_sp.job import TrainConfig

    base = dict(model=files["model"], data=files["train"], eval_data=files["eval"], seq_len=SEQ, steps=STEPS, lr=1e-2,
                deepspeed=files["fp32"], warmup_steps=2, token_cache=files["tokens"])
    return TrainConfig(**{**base, **overrides})


def _run_job(cfg, *, steps_then_stop=None):
    """Fit (or run only ``steps_then_stop`` steps and save, as a preempted job would) and
    return the losses and the final eval; keeps the process group for the next job."""
    from ulysses_sp.job import Job

    job = Job(cfg)
    if steps_then_stop is None:
        losses = job.fit()
    else:
        losses = [job.step(s) for s in range(steps_then_stop)]
        job.save(steps_then_stop)
    result = {"losses": losses, "eval": job.evaluate() if job.has_eval else None, "layout": job.layout}
    return job, result


def _key_scores_case():
    """Two held-out passkey prompts with logits right at every key position, except the last
    key digit of prompt 1 (its position is in the last chunk: rank 0's under zigzag)."""
    from ulysses_sp import init_sequence_parallel, shard_batch
    from ulysses_sp.job.run import key_scores
    from ulysses_sp.tasks import VOCAB_SIZE, passkey_eval_batch

    topo = init_sequence_parallel(2, layout="zigzag")
    prompt = passkey_eval_batch(256, seed=0, index=0)
    answers = shard_batch({"input_ids": prompt["input_ids"].repeat(2, 1), "labels": prompt["answer_labels"].repeat(2, 1)}, topo)["shift_labels"]
    logits = 10 * torch.nn.functional.one_hot(answers.clamp(min=0), VOCAB_SIZE).double()
    if topo.sp_rank == 0:
        last = int(torch.nonzero(answers[1] >= 0).max())
        logits[1, last] = logits[1, last].roll(1)
    return key_scores(logits, answers, topo).tolist()


def _jobs(rank, world, files, out):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    results = {}
    accum = {"deepspeed": None, "packing": False}
    if world == 4:  # DP 2 x SP 2, micro 1: the rows of one micro-2 step of one process, one per DP group
        job, results["padded-dp"] = _run_job(_cfg(files, sp_size=2, **accum))
        job.close(destroy_process_group=False)
        return results
    if world == 2:
        results["key_scores"] = _key_scores_case()
    results["vlm"] = _vlm_job(world, files, out)
    for family in PROCESSED:
        job, results[f"vlm_{family}"] = _run_job(_cfg(files, sp_size=world, model=files[family], data=files[f"{family}_train"], eval_data=None))
        job.close(destroy_process_group=False)
    sp = world
    job, results["packed"] = _run_job(_cfg(files, sp_size=sp, metrics_file=os.path.join(out, f"metrics{world}.jsonl")))
    job.close(destroy_process_group=False)
    # the same update as one big batch: accumulation 2 x micro 1 (padded) vs micro 2 in one step
    job, results["padded-accum"] = _run_job(_cfg(files, sp_size=sp, grad_accum=2, **accum))
    job.close(destroy_process_group=False)
    if world == 1:
        job, results["padded-micro2"] = _run_job(_cfg(files, sp_size=1, micro_batch=2, **accum))
        job.close(destroy_process_group=False)
        return results
    job, results["bf16"] = _run_job(_cfg(files, sp_size=sp, deepspeed=files["bf16"]))
    job.close(destroy_process_group=False)
    # save every 2 steps keeping 2; a preempted run saved at step 3 and resumed
    save = os.path.join(out, "ckpt-every")
    job, results["save-every"] = _run_job(_cfg(files, sp_size=sp, save=save, save_every=2, keep_last=2))
    results["kept"] = sorted(name for name in os.listdir(save) if name.startswith("step"))
    results["latest"] = open(os.path.join(save, "latest")).read().strip()
    job.close(destroy_process_group=False)
    preempted = os.path.join(out, "ckpt-preempted")
    job, _ = _run_job(_cfg(files, sp_size=sp, save=preempted), steps_then_stop=3)
    job.close(destroy_process_group=False)
    job, results["resumed"] = _run_job(_cfg(files, sp_size=sp, save=preempted, resume="latest"))
    job.close(destroy_process_group=False)
    if world == 2:
        results["crash"] = _crash_cases(files, out, sp, save)
    # ZeRO-3 export: from_pretrained gives the engine's logits
    job, results["zero3"] = _run_job(_cfg(files, sp_size=sp, deepspeed=files["zero3"]))
    probe = torch.randint(3, 43, (1, 100), generator=torch.Generator().manual_seed(1))
    engine_logits = job.full_logits(probe)
    export = os.path.join(out, "export")
    job.export(export)
    job.close(destroy_process_group=False)
    model = AutoModelForCausalLM.from_pretrained(export)
    with torch.no_grad():
        exported = model(input_ids=probe).logits
    results["export"] = {"max_diff": float((exported - engine_logits).abs().max()), "dtype": str(model.dtype),
                         "tokenizer": AutoTokenizer.from_pretrained(export)("w1 w2")["input_ids"]}
    dist.barrier()
    return results


def _vlm_job(world, files, out):
    """The tiny LLaVA on its image corpus (packed whole documents, accumulation 2), its eval, and at
    SP=2 the export: loaded with from_pretrained, its loss on one eval document against the engine's."""
    import torch.distributed as dist
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from ulysses_sp.job.image_corpus import ImageRows

    job, result = _run_job(_cfg(files, sp_size=world, model=files["vlm"], data=files["vlm_train"], eval_data=files["vlm_eval"]))
    if world == 2:
        one = ImageRows(files["vlm_eval"], job.processor, SEQ, job.pad_id, packing=False).batch([0])
        with torch.no_grad():
            job.engine.eval()
            result["engine_doc_loss"] = job._loss(job._local(one)).item()
        export = os.path.join(out, "vlm-export")
        job.export(export)
        model, processor = AutoModelForImageTextToText.from_pretrained(export), AutoProcessor.from_pretrained(export)
        n = int(torch.nonzero(one["position_ids"][0] == 0)[1])  # the document's length: the padding's positions start again
        with torch.no_grad():
            out_ = model(input_ids=one["input_ids"][:, :n], pixel_values=one["pixel_values"], labels=one["labels"][:, :n])
        result["export"] = {"doc_loss": out_.loss.item(), "type": type(model).__name__, "processor": type(processor).__name__}
    job.close(destroy_process_group=False)
    dist.barrier()
    return result


def _job_error(cfg) -> str:
    from ulysses_sp.job import JobError

    try:
        job, _ = _run_job(cfg)
    except JobError as e:
        return str(e)
    job.close(destroy_process_group=False)
    return "NO ERROR"


def _crash_cases(files, out, sp, finished):
    """What a kill mid-save leaves, resumed; a resume with changed settings; a finished run resumed;
    a diverging loss. Rank 0 fakes the leftovers between jobs."""
    import shutil

    import torch.distributed as dist

    from ulysses_sp.job import checkpoint

    r = {}
    torn = os.path.join(out, "ckpt-torn")
    metrics = os.path.join(out, "metrics-torn.jsonl")
    job, _ = _run_job(_cfg(files, sp_size=sp, save=torn), steps_then_stop=3)
    job.close(destroy_process_group=False)
    if dist.get_rank() == 0:  # a later save killed after its rename but with a file cut short, then one killed mid-write
        shutil.copytree(os.path.join(torn, "step3"), os.path.join(torn, "step5"))
        state = next(f for f in os.listdir(os.path.join(torn, "step5")) if f.endswith("model_states.pt"))
        with open(os.path.join(torn, "step5", state), "r+b") as f:
            f.truncate(100)
        with open(os.path.join(torn, "latest"), "w") as f:
            f.write("step5")
        os.makedirs(os.path.join(torn, checkpoint.partial_tag(6)))
        with open(metrics, "w") as f:  # the killed run's lines for steps 1-5
            f.writelines(json.dumps({"step": step, "loss": 9.0}) + "\n" for step in range(1, 6))
    dist.barrier()
    job, r["resumed"] = _run_job(_cfg(files, sp_size=sp, save=torn, resume="latest", metrics_file=metrics))
    r["resumed_from"] = job.resumed
    job.close(destroy_process_group=False)
    with open(metrics) as f:
        r["metrics_steps"] = [json.loads(line)["step"] for line in f if "loss" in json.loads(line)]
    job, grown = _run_job(_cfg(files, sp_size=sp, save=torn, resume="latest", metrics_file=metrics, steps=STEPS + 2, keep_last=1))
    job.close(destroy_process_group=False)
    with open(metrics) as f:
        r["grown_lr"] = {line["step"]: line.get("lr") for line in map(json.loads, f) if "loss" in line}
    r["grown_losses"] = grown["losses"]
    r["grown_kept"] = sorted(name for name in os.listdir(torn) if name.startswith("step"))
    r["grown_latest"] = open(os.path.join(torn, "latest")).read()
    r["changed"] = _job_error(_cfg(files, sp_size=sp, save=torn, resume="latest", seq_len=2 * SEQ, seed=1))
    r["fresh_over"] = _job_error(_cfg(files, sp_size=sp, save=torn))
    before = sorted(os.listdir(finished))
    r["finished"] = _run_job(_cfg(files, sp_size=sp, save=finished, save_every=2, keep_last=2, resume="latest"))[1]["losses"]
    r["finished_files"] = (before, sorted(os.listdir(finished)))
    diverging = os.path.join(out, "ckpt-diverging")
    r["nonfinite"] = _job_error(_cfg(files, sp_size=sp, save=diverging, save_every=1, lr=1e30, warmup_steps=0))
    r["nonfinite_kept"] = sorted(f for f in os.listdir(diverging) if f.startswith("step"))
    dist.barrier()
    return r


@functools.cache
def _job_files(config) -> tuple:
    """The session's folder of the jobs' inputs and outputs, and the inputs (made once)."""
    root = str(config._tmp_path_factory.mktemp("job"))
    return root, _make_files(root)


def _calls(config) -> list:
    root, files = _job_files(config)
    return [(world, _jobs, (files, os.path.join(root, f"out{world}")), 900) for world in (2, 4, 1)]


def pool_calls(items) -> list:
    """Each world's jobs, queued behind the cases (tests/conftest.py), if a selected test reads them."""
    reading = [item for item in items if "runs" in item.fixturenames]
    return _calls(reading[0].config) if reading else []


@pytest.fixture(scope="module")
def runs(request, pool):
    root, files = _job_files(request.config)
    calls = _calls(request.config)
    return files, root, {world: got for (world, *_), got in zip(calls, pool_results(pool, calls))}


def _close(a, b, tol):
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= tol, f"step {step + 1}: {x} vs {y}"


def test_packed_run_with_accumulation_equals_one_process(runs):
    """A DeepSpeed config (accumulation 2, lr "auto" from --lr, DeepSpeed's AdamW), packed
    documents (under the balanced layout, auto's for rows packed from --data), SP=2 against one
    rank: loss per step within 1e-4, falling; eval loss within 1e-5."""
    _, _, out = runs
    sp2, single = out[2][0]["packed"], out[1][0]["packed"]
    assert sp2["layout"] == "balanced", sp2["layout"]
    assert out[2][0]["packed"] == out[2][1]["packed"]
    _close(sp2["losses"], single["losses"], 1e-4)
    assert sp2["losses"][-1] < 0.9 * sp2["losses"][0], sp2["losses"]
    assert abs(sp2["eval"]["eval_loss"] - single["eval"]["eval_loss"]) < 1e-5
    assert sp2["eval"]["eval_tokens"] == single["eval"]["eval_tokens"] > 0


def test_accumulation_is_the_same_update_as_one_big_batch(runs):
    """Micro 1 x accumulation 2 on SP=2 equals micro 2 in one step on one rank: the loss is
    token-weighted over the whole step, not averaged per micro-step (padded rows hold
    different numbers of tokens, so an average per micro-step would differ)."""
    _, _, out = runs
    _close(out[2][0]["padded-accum"]["losses"], out[1][0]["padded-micro2"]["losses"], 1e-4)
    _close(out[1][0]["padded-accum"]["losses"], out[1][0]["padded-micro2"]["losses"], 1e-5)


def test_data_parallel_groups_share_the_step_exactly(runs):
    """DP 2 x SP 2 on 4 ranks, micro 1 each, equals one process with micro 2: the DP groups'
    rows together are the one process's batch, and the loss is weighted by tokens across
    groups. The 7 eval documents split 4 + 3 (the short group runs a batch without targets)."""
    _, _, out = runs
    dp, single = out[4][0]["padded-dp"], out[1][0]["padded-micro2"]
    assert all(r["padded-dp"] == dp for r in out[4])
    _close(dp["losses"], single["losses"], 1e-4)
    assert abs(dp["eval"]["eval_loss"] - single["eval"]["eval_loss"]) < 1e-5
    assert dp["eval"]["eval_tokens"] == single["eval"]["eval_tokens"]


def test_passkey_scores_count_each_prompt_and_digit_once(runs):
    """Summed over the 2 ranks: prompt 0 retrieved, prompt 1 not (one wrong digit on rank 0),
    9 of 10 key digits right, and the key loss of nine right digits and a wrong one."""
    _, _, out = runs
    retrieved, right, digits, loss = (sum(v) for v in zip(*(r["key_scores"] for r in out[2])))
    assert (retrieved, right, digits) == (1, 9, 10)
    lse = math.log(math.exp(10) + 256)  # one logit at 10, 256 at 0
    assert loss == pytest.approx(lse + 9 * (lse - 10), rel=1e-6)


def test_bf16_config_trains_close_to_fp32(runs):
    _, _, out = runs
    bf16, fp32 = out[2][0]["bf16"]["losses"], out[2][0]["packed"]["losses"]
    assert bf16 != fp32
    _close(bf16, fp32, 0.03 * max(fp32))


def test_save_every_keeps_the_last_and_resume_latest_continues_identically(runs):
    _, _, out = runs
    r = out[2][0]
    assert (r["kept"], r["latest"]) == (["step4", "step6"], "step6")
    assert r["save-every"]["losses"] == r["packed"]["losses"]
    assert r["resumed"]["losses"] == r["packed"]["losses"][3:]
    assert r["resumed"]["eval"] == r["packed"]["eval"]


def test_resume_skips_what_a_killed_save_left_and_continues_identically(runs):
    """A checkpoint whose file a kill cut short (named by latest) and a half-written one: resume
    takes the intact step 3, with the losses of an uninterrupted run; the metrics file keeps the
    killed run's steps 1-3 and gets 4-6 once each."""
    _, _, out = runs
    r, packed = out[2][0]["crash"], out[2][0]["packed"]
    assert r["resumed_from"] == "step3"
    assert r["resumed"]["losses"] == packed["losses"][3:]
    assert r["metrics_steps"] == list(range(1, STEPS + 1))


def test_resume_with_changed_settings_is_refused_on_every_rank(runs):
    _, _, out = runs
    for rank in out[2]:
        message = rank["crash"]["changed"]
        assert "--resume: checkpoint step8 was trained with other settings" in message, message  # the newest: --steps grown to 8
        assert "seq_len: checkpoint 128, now 256" in message and "seed: checkpoint 0, now 1" in message


def test_steps_may_grow_on_resume_and_the_schedule_is_replanned(runs):
    """From the finished 6-step run, --steps 8: two more steps whose learning rates are those of
    a warmup + cosine planned for 8 steps (the schedule is re-planned over the new total, so the
    rate moves up from where the 6-step plan had it); the metrics keep steps 1-6 as they were.
    With --keep-last 1 only step8 of the run is kept (the torn step5 is not the run's), and
    latest names it."""
    import torch
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    def planned(total):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-2)
        sched = get_cosine_with_min_lr_schedule_with_warmup(opt, 2, total, min_lr_rate=0.1)
        lrs = []
        for _ in range(total):
            lrs.append(sched.get_last_lr()[0])
            opt.step()
            sched.step()
        return lrs

    _, _, out = runs
    r = out[2][0]["crash"]
    assert len(r["grown_losses"]) == 2
    assert sorted(r["grown_lr"]) == list(range(1, STEPS + 3))  # steps 1-3: the killed run's lines (no lr), kept
    assert [r["grown_lr"][s] for s in range(4, STEPS + 3)] == pytest.approx(planned(STEPS)[3:] + planned(STEPS + 2)[STEPS:], rel=1e-9)
    assert planned(STEPS + 2)[STEPS] > planned(STEPS)[STEPS - 1]
    assert (r["grown_kept"], r["grown_latest"]) == (["step5", "step8"], "step8")


def test_a_fresh_run_into_a_directory_of_checkpoints_is_refused(runs):
    _, _, out = runs
    for rank in out[2]:
        assert "already holds checkpoints" in rank["crash"]["fresh_over"] and "--resume latest" in rank["crash"]["fresh_over"]


def test_resuming_a_finished_run_writes_nothing_over_it(runs):
    _, _, out = runs
    r = out[2][0]["crash"]
    assert r["finished"] == []
    assert r["finished_files"][0] == r["finished_files"][1]


def test_a_non_finite_loss_stops_the_job_before_it_steps_or_saves(runs):
    """lr 1e30: step 1 trains and is saved; step 2's loss is not finite, so every rank stops
    there with the reason, and no checkpoint holds the diverged weights."""
    _, _, out = runs
    for rank in out[2]:
        assert "step 2: the loss of micro-batch 1 is not finite on 2 of 2 ranks" in rank["crash"]["nonfinite"], rank["crash"]["nonfinite"]
        assert os.path.join("ckpt-diverging", "step1 (--resume latest restarts there)") in rank["crash"]["nonfinite"], rank["crash"]["nonfinite"]
    assert out[2][0]["crash"]["nonfinite_kept"] == ["step1"]


def test_zero3_export_loads_with_the_engines_logits(runs):
    _, _, out = runs
    r = out[2][0]
    _close(r["zero3"]["losses"], r["packed"]["losses"], 1e-4)
    assert r["export"]["max_diff"] < 1e-5, r["export"]
    assert r["export"]["dtype"] == "torch.float32" and r["export"]["tokenizer"] == [4, 5]


def test_image_text_model_trains_evaluates_and_exports(runs):
    """train.py's path for an image-text model directory (tiny LLaVA with its processor, JSON lines
    of images and text): SP=2 equals one process step by step, the loss falls, and the export
    loads with from_pretrained and gives the engine's loss on an eval document."""
    _, _, out = runs
    sp2, single = out[2][0]["vlm"], out[1][0]["vlm"]
    assert out[2][1]["vlm"]["losses"] == sp2["losses"]
    _close(sp2["losses"], single["losses"], 1e-4)
    assert sp2["losses"][-1] < 0.9 * sp2["losses"][0], sp2["losses"]
    assert abs(sp2["eval"]["eval_loss"] - single["eval"]["eval_loss"]) < 1e-5 and sp2["eval"]["eval_tokens"] > 0
    assert sp2["export"]["type"] == "LlavaForConditionalGeneration" and sp2["export"]["processor"] == "LlavaProcessor"
    assert abs(sp2["export"]["doc_loss"] - sp2["engine_doc_loss"]) < 1e-5, sp2


@pytest.mark.parametrize("family", PROCESSED)
def test_image_text_families_train_from_their_processors(runs, family):
    """train.py's path for each family from its own processor's inputs: Gemma 3's token_type_ids (each image's 16
    tokens attend to each other both ways, a window of 16 on the sliding layer), LLaVA-NeXT's anyres tiles of images
    of two sizes (padded to the most tiles), Idefics3's crops and global views (a row's images padded with all-zero
    ones): SP=2 equals one process step by step and the loss falls."""
    _, _, out = runs
    sp2, single = out[2][0][f"vlm_{family}"], out[1][0][f"vlm_{family}"]
    assert out[2][1][f"vlm_{family}"]["losses"] == sp2["losses"]
    _close(sp2["losses"], single["losses"], 1e-4)
    assert sp2["losses"][-1] < 0.9 * sp2["losses"][0], sp2["losses"]


def test_metrics_file_has_a_line_per_step_and_the_eval(runs):
    _, root, _ = runs
    with open(os.path.join(root, "out2", "metrics2.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    steps = [line for line in lines if "loss" in line]
    assert [line["step"] for line in steps] == list(range(1, STEPS + 1))
    assert all(len(line["peak_memory_mib"]) == 2 and line["tokens_per_s"] > 0 and line["lr"] >= 0 for line in steps)
    assert steps[0]["lr"] == 0.0 and steps[2]["lr"] == pytest.approx(1e-2)  # linear warmup over 2 steps, then the peak
    assert steps[0]["mfu"] is None and steps[0]["tflops_per_rank"] > 0  # no known peak on CPU
    assert lines[-1]["step"] == STEPS and "eval_loss" in lines[-1]
    # each step's slowest rank's attention work over the mean, under the balanced layout of these packed rows
    assert all(1.0 <= line["work_imbalance"] <= 1.1 for line in steps), [line["work_imbalance"] for line in steps]
