"""The main job's inputs without a process group: DeepSpeed config resolution, packing, the
passkey eval, and the errors users meet first (one clear line, before any collective)."""

import json
import os
import tempfile
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
pytest.importorskip("transformers", reason="the hf extra is not installed")

from ulysses_sp.data import IGNORE_INDEX, shard_batch  # noqa: E402
from ulysses_sp.job import Job, JobError, TrainConfig, parse_args  # noqa: E402
from ulysses_sp.job.corpus import pack, pad_each  # noqa: E402
from ulysses_sp.job.ds_config import resolve_ds_config  # noqa: E402
from ulysses_sp.tasks import EOS_ID, passkey_batch, passkey_eval_batch  # noqa: E402


@pytest.mark.parametrize("given,cores,local,expected", [(64, 64, 8, 8), (64, 64, 1, 64), (1, 64, 8, 1), (2, 2, 1, 2), (1, 2, 1, 1), (4, 2, 4, 1)])
def test_a_cpu_rank_takes_its_share_of_the_cores_and_no_more_threads_than_given(monkeypatch, given, cores, local, expected):
    from ulysses_sp.job import run

    monkeypatch.setattr(run.torch, "get_num_threads", lambda: given)
    monkeypatch.setattr(run.os, "cpu_count", lambda: cores)
    assert run.cpu_threads(local) == expected


def _resolve(user=None, dp=1, sp=2, **flags):
    cfg = TrainConfig(sp_size=sp, **flags)
    return resolve_ds_config(cfg, user or {}, dp_size=dp, sp_size=sp, on_gpu=False, pretrained=False)


@pytest.mark.quick
def test_defaults_fill_an_empty_config_and_say_so():
    r = _resolve()
    assert (r.micro_batch, r.grad_accum, r.zero_stage, r.dtype, r.lr) == (1, 1, 2, "fp32", 3e-3)
    assert not r.ds_optimizer and not r.ds_scheduler
    assert r.config["zero_optimization"]["stage"] == 2 and r.config["gradient_clipping"] == 1.0
    assert "train_batch_size" not in r.config
    assert r.sources["micro batch"] == "1 (default)" and r.sources["precision"] == "fp32 (default on CPU)"
    assert r.warmup_steps == 10  # 5% of 200


def test_config_values_win_and_flags_fill_auto():
    user = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 4, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": [0.9, 0.95]}},
            "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto", "warmup_num_steps": "auto"}}}
    r = _resolve(user, micro_batch=2, lr=1e-4, steps=100, warmup_steps=7, packing=False)
    assert (r.micro_batch, r.grad_accum, r.zero_stage, r.dtype) == (2, 4, 3, "bf16")
    assert r.config["optimizer"]["params"] == {"lr": 1e-4, "betas": [0.9, 0.95]}
    assert r.config["scheduler"]["params"] == {"total_num_steps": 100, "warmup_num_steps": 7}
    assert r.ds_optimizer and r.ds_scheduler
    assert r.sources["gradient accumulation"] == "4 (config)" and r.sources["micro batch"] == "2 (flag)"
    assert user["train_micro_batch_size_per_gpu"] == "auto"  # the user's dict is not changed


def test_train_batch_size_counts_sequences_over_dp_groups():
    """4 ranks at SP 2 are 2 DP groups: 8 sequences per step are micro 1 x accumulation 4 x 2."""
    r = _resolve({"train_batch_size": 8}, dp=2)
    assert r.grad_accum == 4 and "train_batch_size" not in r.config
    with pytest.raises(JobError, match=r"train_batch_size 8 is not micro batch x accumulation x DP groups = 1 x 3 x 2"):
        _resolve({"train_batch_size": 8, "gradient_accumulation_steps": 3}, dp=2)


@pytest.mark.parametrize("user, flags, message", [
    ({"zero_optimization": {"stage": 3}}, {"zero_stage": 2}, "--zero-stage 2 contradicts the DeepSpeed config's zero_optimization.stage 3"),
    ({"bf16": {"enabled": True}}, {"dtype": "fp32"}, "--dtype fp32 contradicts the DeepSpeed config's precision bf16"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, {}, "enables both bf16 and fp16"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, {"lr": 1e-4}, "--lr 0.0001 contradicts"),
    ({"train_micro_batch_size_per_gpu": 2}, {"data": "x.jsonl"}, "micro batch 2 with packing"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "auto"}}}, {}, r"sets scheduler.params.warmup_type to \"auto\""),
])
def test_contradictions_are_errors(user, flags, message):
    with pytest.raises(JobError, match=message):
        _resolve(user, **flags)


def test_offloaded_optimizer_gets_deepspeeds_adam():
    r = _resolve({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, lr=1e-4)
    assert r.config["optimizer"] == {"type": "AdamW", "params": {"weight_decay": 0.0, "lr": 1e-4}} and r.ds_optimizer


def test_parse_args_takes_both_deepspeed_spellings_and_the_hf_names():
    assert parse_args(["--deepspeed", "a.json"]).deepspeed == "a.json"
    assert parse_args(["--deepspeed", "--deepspeed_config", "a.json"]).deepspeed == "a.json"
    cfg = parse_args(["--gradient-checkpointing", "--gradient-accumulation-steps", "2", "--micro-batch-size", "3", "--no-packing"])
    assert (cfg.checkpoint, cfg.grad_accum, cfg.micro_batch, cfg.packing) == ("layers", 2, 3, False)


@pytest.mark.parametrize("argv, message", [
    (["--deepspeed", "a.json", "--deepspeed_config", "b.json"], "name different files"),
    (["--resume", "latest"], "--resume latest looks in the --save directory"),
    (["--gradient-checkpointing", "--checkpoint", "none"], "contradicts --checkpoint none"),
    (["--seq-len", "0"], "must be at least 1"),
])
def test_parse_args_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_packing_restarts_positions_per_document_and_row():
    docs = [[1, 2, 3, 9], [4, 5, 9], [6, 7, 8, 1, 2, 9]]  # 13 tokens, rows of 6
    rows = pack(docs, 6, pad_id=0)
    batch = rows.batch(range(len(rows)))
    assert batch["input_ids"].tolist() == [[1, 2, 3, 9, 4, 5], [9, 6, 7, 8, 1, 2], [9, 0, 0, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1], [0, 0, 1, 2, 3, 4], [0, 0, 1, 2, 3, 4]]
    assert batch["labels"][2].tolist() == [9] + [IGNORE_INDEX] * 5
    padded = pad_each(docs, 4, pad_id=0)
    batch = padded.batch(range(len(padded)))
    assert batch["input_ids"].tolist() == [[1, 2, 3, 9], [4, 5, 9, 0], [6, 7, 8, 1], [2, 9, 0, 0]]
    assert batch["labels"][1].tolist() == [4, 5, 9, IGNORE_INDEX]


@pytest.mark.parametrize("seed", range(3))
def test_rows_equal_the_stream_cut_one_token_at_a_time(seed):
    """The rows built on demand from the token file against the definition, token by token:
    packed, a document starts at each document and row start and the padding is one more;
    padded, each seq_len piece of a document is a row."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, 50, (int(n),), generator=g).tolist() + [99] for n in torch.randint(0, 30, (25,), generator=g)]
    seq = 8
    stream = [t for d in docs for t in d]
    doc_start = {sum(map(len, docs[:i])) for i in range(len(docs))}
    ids, pos, labels, p = [], [], [], 0
    for i in range(-(-len(stream) // seq) * seq):
        p = 0 if (i in doc_start or i % seq == 0 or i == len(stream)) else p + 1
        ids.append(stream[i] if i < len(stream) else 0)
        labels.append(stream[i] if i < len(stream) else IGNORE_INDEX)
        pos.append(p)
    rows = pack(docs, seq, pad_id=0)
    batch = rows.batch(range(len(rows)))
    for key, want in (("input_ids", ids), ("labels", labels), ("position_ids", pos)):
        assert batch[key].flatten().tolist() == want, key
    pieces = [d[i : i + seq] for d in docs for i in range(0, len(d), seq)]
    padded = pad_each(docs, seq, pad_id=0)
    batch = padded.batch(range(len(padded)))
    assert batch["input_ids"].tolist() == [piece + [0] * (seq - len(piece)) for piece in pieces]
    assert batch["labels"].tolist() == [piece + [IGNORE_INDEX] * (seq - len(piece)) for piece in pieces]


def test_a_documents_first_token_is_not_the_previous_ones_target():
    rows = pack([[1, 2, 3, 9], [4, 5, 9], [6, 7, 9]], 10, pad_id=0)
    topo = SimpleNamespace(layout="contiguous", sp_size=1, sp_rank=0)
    local = shard_batch(rows.batch([0]), topo)
    # targets: 2 3 9 | - (not 4) | 5 9 | - (not 6) | 7 9 | - (end)
    assert local["shift_labels"][0].tolist() == [2, 3, 9, IGNORE_INDEX, 5, 9, IGNORE_INDEX, 7, 9, IGNORE_INDEX]
    assert local["cu_seqlens"].tolist() == [0, 4, 7, 10]


def test_passkey_eval_prompts_are_held_out_and_mark_the_key():
    b = passkey_eval_batch(256, seed=0, index=3)
    key = b["answer_labels"][0][b["answer_labels"][0] != IGNORE_INDEX]
    assert key.tolist() == [0x80 + 10 * k + d for k, d in enumerate((key - 0x80) % 10)], "symbol k is one of ten bytes of its own"
    assert torch.equal(b["input_ids"][0, -5:], key) and torch.equal(b["labels"], b["answer_labels"])
    training = {tuple(passkey_batch(256, seed=0, step=s, dp_rank=0)["input_ids"][0].tolist()) for s in range(50)}
    assert tuple(b["input_ids"][0].tolist()) not in training


def _job_error(monkeypatch, world=2, **fields):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("XDG_CACHE_HOME", os.path.join(tempfile.gettempdir(), "ulysses_sp-test-cache"))  # token files not in ~/.cache
    with pytest.raises(JobError) as e:
        Job(TrainConfig(**fields))
    return str(e.value)


def test_launch_errors_come_before_any_process_group(monkeypatch, tmp_path):
    """Every rank raises the same JobError from its own arguments: no collective is reached."""
    assert "--sp-size 3 does not divide the 2 ranks" in _job_error(monkeypatch, sp_size=3)
    assert "--seq-len 1001 is not a multiple of 2 x sp = 4" in _job_error(monkeypatch, seq_len=1001)
    assert "--seq-len: seq_len 20 is too short for the passkey task (need at least 23)" in _job_error(monkeypatch, seq_len=20)
    assert "--engine fsdp2 takes no --deepspeed, --zero-stage" in _job_error(monkeypatch, engine="fsdp2", deepspeed="a.json", zero_stage=3)
    assert "--engine fsdp2 takes no --dtype fp16" in _job_error(monkeypatch, engine="fsdp2", dtype="fp16")
    assert "--engine 'fsdp': choose from deepspeed, fsdp2" in _job_error(monkeypatch, engine="fsdp")
    assert "--seq-len 32 leaves no place for a held-out pass key on other ranks" in _job_error(monkeypatch, seq_len=32, layout="balanced")
    bad = tmp_path / "ds.json"
    bad.write_text("{not json")
    assert "cannot read it as JSON" in _job_error(monkeypatch, deepspeed=str(bad))
    assert "--data nowhere.jsonl: no such file" in _job_error(monkeypatch, data="nowhere.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": ""}) + "\n")
    assert "no non-empty 'text' records" in _job_error(monkeypatch, data=str(empty))
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text(json.dumps({"content": "abc"}) + "\n")
    assert "no 'text' column (columns: content)" in _job_error(monkeypatch, data=str(wrong))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert "no tokenizer could be loaded from" in _job_error(monkeypatch, model=str(tmp_path / "model"), data=str(wrong))
    assert "is a config file, without a tokenizer for --data" in _job_error(
        monkeypatch, model=str(tmp_path / "model" / "config.json"), data=str(wrong))
    (tmp_path / "vlm").mkdir()
    (tmp_path / "vlm" / "config.json").write_text(json.dumps({"model_type": "llava", "vision_config": {}}))
    assert "an image-text --model with ZeRO-3: each image is encoded on one rank" in _job_error(monkeypatch, model=str(tmp_path / "vlm"), zero_stage=3)


def test_outputs_and_resume_are_checked_before_any_process_group(monkeypatch, tmp_path):
    """An output the job would write after its first step (metrics), at a save, or at the end
    (export) fails at once, on every rank, as does a model directory without weights."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert "--save " + str(a_file) + ": exists and is not a directory" in _job_error(monkeypatch, save=str(a_file))
    assert f"{a_file} is a file, not a directory" in _job_error(monkeypatch, export_hf=str(a_file / "export"))
    assert "is a directory; give a file name" in _job_error(monkeypatch, metrics_file=str(tmp_path))
    assert f"--token-cache {a_file}: exists and is not a directory" in _job_error(monkeypatch, data=str(a_file), token_cache=str(a_file))
    assert "--resume latest looks in the --save directory" in _job_error(monkeypatch, resume="latest")
    assert "no such directory" in _job_error(monkeypatch, resume=str(tmp_path / "nowhere"))
    assert "--keep-last 0: keep at least the newest checkpoint" in _job_error(monkeypatch, save=str(tmp_path / "c"), keep_last=0)
    assert "--dist-timeout 0: give the seconds the ranks may wait" in _job_error(monkeypatch, dist_timeout=0)
    assert "--io-timeout -1: give the seconds the ranks may wait" in _job_error(monkeypatch, io_timeout=-1)
    from ulysses_sp.testing.tiny_checkpoint import write_tiny_llama

    write_tiny_llama(str(tmp_path / "tiny"))
    for weights in (tmp_path / "tiny").glob("*.safetensors"):
        weights.unlink()
    message = _job_error(monkeypatch, model=str(tmp_path / "tiny"))
    assert f"--model {tmp_path / 'tiny'}: no weight files (*.safetensors, *.bin) there; to train this architecture from random weights, add --from-scratch" in message


def test_utilisation_peak_by_device_and_flops_per_token(monkeypatch):
    """The CUDA branch of the MFU estimate without a GPU: a known device's bf16 peak, none for fp32,
    an unknown device or the CPU (unless given), and the FLOPs formula on a Llama shape."""
    from transformers import LlamaConfig

    from ulysses_sp.job.metrics import flops_per_token, peak_tflops

    monkeypatch.setattr("torch.cuda.get_device_name", lambda *a, **k: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda", 0)
    assert peak_tflops(cuda, "bf16", None) == 989.0 and peak_tflops(cuda, "fp32", None) is None
    assert peak_tflops(torch.device("cpu"), "bf16", None) is None and peak_tflops(torch.device("cpu"), "fp32", 1.5) == 1.5
    monkeypatch.setattr("torch.cuda.get_device_name", lambda *a, **k: "Some Future GPU")
    assert peak_tflops(cuda, "bf16", None) is None
    config = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=64, head_dim=16)
    assert flops_per_token(config, 1000, 512) == 6 * 1000 + 6 * 2 * 4 * 16 * 512


def test_records_without_text_are_counted(tmp_path):
    from ulysses_sp.job.tokens import token_file

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("a", "", None, "b")))
    said = []
    tf = token_file(str(data), None, str(tmp_path / "cache"), builder=True, say=said.append)
    assert tf.tokens.tolist() == [ord("a"), EOS_ID, ord("b"), EOS_ID] and tf.ends.tolist() == [2, 4]
    assert f"{data}: 2 of 4 records have no text (empty, null or not a string) and are skipped" in said


def test_sft_rows_hold_whole_documents_with_targets_on_completions_only(tmp_path):
    from ulysses_sp.job.completion_corpus import CompletionRows
    from ulysses_sp.testing.tiny_checkpoint import _tokenizer

    tok = _tokenizer()
    data = tmp_path / "sft.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [{"prompt": "w1 w2 w3", "completion": " w4 w5"},
                                                      {"prompt": "w7", "completion": " w8 w9 w10"}]) + "\n")
    rows = CompletionRows(str(data), tok, 16, 1, packing=True)
    assert len(rows) == 1
    b = rows.batch([0])
    eos = tok.eos_token_id
    w = lambda *ks: [tok.convert_tokens_to_ids(f"w{k}") for k in ks]  # noqa: E731
    assert b["input_ids"][0].tolist() == w(1, 2, 3, 4, 5) + [eos] + w(7, 8, 9, 10) + [eos] + [1] * 5
    assert b["labels"][0].tolist() == [IGNORE_INDEX] * 3 + w(4, 5) + [eos] + [IGNORE_INDEX] + w(8, 9, 10) + [eos] + [IGNORE_INDEX] * 5
    assert b["position_ids"][0].tolist() == list(range(6)) + list(range(5)) + list(range(5))
    assert len(CompletionRows(str(data), tok, 16, 1, packing=False)) == 2
    with pytest.raises(JobError, match="line 1: 6 tokens, more than --seq-len 5"):
        CompletionRows(str(data), tok, 5, 1, packing=True)
    data.write_text(json.dumps({"text": "w1"}) + "\n")
    with pytest.raises(JobError, match="line 1: --task sft reads JSON lines with 'prompt', 'completion' strings"):
        CompletionRows(str(data), tok, 16, 1, packing=True)


def test_dpo_rows_keep_each_pair_in_one_row(tmp_path):
    from ulysses_sp.job.completion_corpus import CompletionRows
    from ulysses_sp.testing.tiny_checkpoint import _tokenizer

    tok = _tokenizer()
    data = tmp_path / "dpo.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [{"prompt": "w1 w2", "chosen": " w3", "rejected": " w9 w8"},
                                                      {"prompt": "w5", "chosen": " w6 w7", "rejected": " w0"}]) + "\n")
    rows = CompletionRows(str(data), tok, 12, 1, packing=True, task="dpo")
    assert len(rows) == 2 and rows.documents(0) == 2  # the second pair (7 tokens) does not fit beside the first (7): a row of its own
    eos, w = tok.eos_token_id, (lambda *ks: [tok.convert_tokens_to_ids(f"w{k}") for k in ks])  # noqa: E731
    b = rows.batch([0])
    assert b["input_ids"][0].tolist() == w(1, 2, 3) + [eos] + w(1, 2, 9, 8) + [eos] + [1] * 3
    assert b["labels"][0].tolist() == [IGNORE_INDEX] * 2 + w(3) + [eos] + [IGNORE_INDEX] * 2 + w(9, 8) + [eos] + [IGNORE_INDEX] * 3
    assert b["documents"].tolist() == [2]
    with pytest.raises(JobError, match="line 1: 9 tokens, more than --seq-len 8; a prompt and its chosen and rejected are never cut"):
        CompletionRows(str(data), tok, 8, 1, packing=True, task="dpo")


@pytest.mark.parametrize("argv,message", [
    (["--task", "sft"], "--task sft needs --data"),
    (["--task", "dpo"], "--task dpo needs --data"),
    (["--task", "dpo", "--data", __file__, "--tiled-loss"], "--task dpo takes no --tiled-loss"),
])
def test_sft_and_dpo_tasks_refuse_what_they_cannot_take(argv, message):
    from ulysses_sp.job.config import check_launch

    with pytest.raises(JobError, match=message):
        check_launch(parse_args([*argv, "--seq-len", "64"]), 2)


def test_a_model_that_refuses_packed_rows_is_stopped_before_training_on_them():
    """DeepSeek-V4 on packed rows (--data packed, the passkey task's, --task dpo's) stops with the reason and the flag (its
    first forward would refuse them after the engine's start); one document a row passes."""
    import transformers

    from ulysses_sp.job.run import packing_problem

    with torch.device("meta"):
        v4 = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV4Config(num_hidden_layers=1, layer_types=["sliding_attention"],
                                                                                          mlp_layer_types=["moe"]))
        llama = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(num_hidden_layers=1))
    packed = TrainConfig(data=__file__)
    assert "packed rows are not supported: DeepSeek-V4 compresses windows" in packing_problem(packed, v4)
    assert packing_problem(packed, v4).endswith("pass one document a row: add --no-packing")
    assert "--task dpo puts each pair's two replies in one row" in packing_problem(TrainConfig(data=__file__, task="dpo", packing=False), v4)
    assert packing_problem(TrainConfig(), v4).endswith("the passkey task packs its documents, so train it on --data with --no-packing")
    assert packing_problem(TrainConfig(data=__file__, packing=False), v4) is None
    assert packing_problem(packed, llama) is None
