"""ulysses_sp.integrations.trl: TRL's SFT, DPO and GRPO trainers under SP (2 and 3 ranks) and DP2 x SP2
against the TRL trainer on one process, on a tiny Llama and a hybrid (Qwen3.5: Gated DeltaNet and
attention). Cases in tests/trl_cases.py; the SP runs of each world size in one call on the session's
pool of ranks, the references on the 1-rank pool. TRL's defaults but fp32 (gradient checkpointing on:
its recompute runs after the SP fused head's other forwards), two optimizer steps of accumulated
micro-batches; SGD without clipping (an SGD step shows a gradient off by a constant factor, Adam's
would not) and one AdamW case. Negative control: each rank summing its own tokens' log-probabilities
(a per-rank loss) moves the DPO loss far beyond the tolerance.
"""

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="not installed: trl (extra trl)")

from .conftest import pool_results  # noqa: E402
from .trl_cases import SP_CASES, STEPS, run_references, run_sp_cases  # noqa: E402

TOL = 1e-5
EXACT = [(world, name) for world, cases in SP_CASES.items() for name in cases if "per-rank" not in name and "mis-scaled" not in name]
COMPARED = {"dpo": ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "entropy"),
            "sft": ("loss", "entropy", "mean_token_accuracy"),
            "grpo": ("loss", "kl", "entropy", "reward", "reward_std", "rewards/_reward/std", "clip_ratio/region_mean")}


NAMED = {"test_per_rank_sums_are_far_off": (2, "dpo-llama/sp2/per-rank-sums"),
         "test_one_mis_scaled_micro_batch_is_caught": (2, "dpo-llama-uneven/sp2/mis-scaled"),
         "test_grpo_group_trains_on_the_first_ranks_completions": (2, "grpo-llama-grpo/sp2/diverging-samples"),
         "test_sft_packed_rows_use_the_balanced_layout": (2, "sft-llama-packed/sp2")}
"""The case each unparametrized test reads."""


def pool_calls(items) -> list:
    """The reference runs of the cases the selected tests read (the quick slice reads three) on the
    1-rank pool, and each world's SP runs in one call on its pool (tests/conftest.py queues them behind the cases)."""
    wanted = set()
    for item in (item for item in items if "runs" in item.fixturenames):
        params = getattr(getattr(item, "callspec", None), "params", {})
        wanted.add((params["world"], params["name"]) if "name" in params else NAMED[item.originalname])
    if not wanted:
        return []
    refs = sorted({SP_CASES[w][n][0] for w, n in wanted})
    return [(1, run_references, (refs,), 600)] + [(world, run_sp_cases, (sorted(n for w, n in wanted if w == world),), 600)
                                                  for world in sorted({w for w, _ in wanted})]


@pytest.fixture(scope="module")
def runs(pool, request):
    """(reference results by name, {world: [each rank's results by case name]}) of ``pool_calls``."""
    calls = pool_calls([item for item in request.session.items if item.module is request.module])
    ref, *sp = pool_results(pool, calls)
    return ref[0], {world: got for (world, *_), got in zip(calls[1:], sp)}


def _ok(result, what):
    if not result["ok"]:
        pytest.fail(f"{what} raised:\n{result['error']}")
    return result["value"]


def _pair(runs, world, name):
    refs, sp = runs
    ref_name, _ = SP_CASES[world][name]
    return _ok(refs[ref_name], f"reference {ref_name}"), [_ok(r[name], f"{name} on rank {i}") for i, r in enumerate(sp[world])]


def _worst_param_error(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.mark.parametrize("world,name", EXACT, ids=[f"P{w}-{n}" for w, n in EXACT])
@pytest.mark.quick(name=("dpo-llama/sp2", "sft-llama-packed/sp2", "grpo-llama-grpo/sp2"))
def test_trl_trainer_equals_one_process(runs, world, name):
    """Every logged loss and metric TRL computes from the whole rows (DPO's rewards and log-probabilities,
    GRPO's KL, entropy and clipping), every parameter after the steps and DPO's and GRPO's evaluate(), on
    every rank. (SFT's eval loss is the Trainer's, token-weighted, tested in tests/test_hf_trainer.py.)"""
    ref, ranks = _pair(runs, world, name)
    trainer = SP_CASES[world][name][1]["trainer"]
    steps = [h for h in ref["logged"] if "loss" in h]
    assert len(steps) == STEPS
    moved = _worst_param_error(ref["params"], ref["initial"])
    assert moved > 1e-3, f"the reference must train, else equal parameters prove little (moved {moved})"
    for rank, r in enumerate(ranks):
        got = [h for h in r["logged"] if "loss" in h]
        # TRL shuffles each generation batch and logs its micro-batches' means: under DP the micro-batches
        # hold other samples than on one process, so only the window's loss and reward compare there
        keys = ("loss", "reward", "reward_std", "rewards/_reward/std") if trainer == "grpo" and world == 4 else COMPARED[trainer]
        for key in keys:
            for a, b in zip(steps, got):
                if key in a:
                    assert abs(a[key] - b[key]) < TOL, f"rank {rank} {key}: {b[key]} vs one process {a[key]}"
        error = _worst_param_error(ref["params"], r["params"])
        assert error < TOL, f"rank {rank}: parameters {error:.3g} from one process"
        if trainer != "sft":  # evaluate() after training: TRL's own evaluation loop and metrics, whole batches per DP group
            assert ref["eval"].keys() == r["eval"].keys(), (ref["eval"], r["eval"])
            for key in ("eval_loss", "eval_rewards/chosen", "eval_rewards/margins", "eval_reward", "eval_kl"):
                if key in ref["eval"]:
                    assert abs(ref["eval"][key] - r["eval"][key]) < TOL, f"rank {rank} {key}: {r['eval'][key]} vs one process {ref['eval'][key]}"


def test_per_rank_sums_are_far_off(runs):
    """The negative control: each rank's loss from its own tokens' log-probabilities (a per-rank mean
    in place of the group's sum) moves the DPO loss by more than 1e-2 at the second step."""
    ref, ranks = _pair(runs, 2, "dpo-llama/sp2/per-rank-sums")
    first = [h["loss"] for h in ref["logged"] if "loss" in h]
    got = [h["loss"] for h in ranks[0]["logged"] if "loss" in h]
    assert abs(got[-1] - first[-1]) > 1e-2, (got, first)


def test_one_mis_scaled_micro_batch_is_caught(runs):
    """The negative control of the accumulation: one micro-batch of four with its gradient 1.5x (uneven
    pairs, one a micro-batch) moves the parameters beyond the tolerance the exact cases meet."""
    ref, ranks = _pair(runs, 2, "dpo-llama-uneven/sp2/mis-scaled")
    assert _worst_param_error(ref["params"], ranks[0]["params"]) > 100 * TOL


@pytest.mark.parametrize("trainer", ["SFT", "DPO", "GRPO"])
def test_sp_configs_keep_the_trl_defaults(trainer):
    """Every field of TRL's config has TRL's default in ulysses_sp's: the SP configs once took
    TrainingArguments' (bf16 off where TRL turns it on, DPO's learning rate 5e-5 for TRL's 1e-6, no
    gradient checkpointing, GRPO's remove_unused_columns), so SP trained another recipe than the one
    process it was compared with (DPO off by 1e-3 on issue 71's data: one process ran bf16 autocast)."""
    import dataclasses

    import trl

    from ulysses_sp.integrations import trl as sp_trl

    def defaults(cls):
        return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory for f in dataclasses.fields(cls)}

    theirs, ours = defaults(getattr(trl, f"{trainer}Config")), defaults(getattr(sp_trl, f"SequenceParallel{trainer}Config"))
    assert {k: (v, ours[k]) for k, v in theirs.items() if ours[k] != v} == {}
    made = getattr(sp_trl, f"SequenceParallel{trainer}Config")(output_dir="unused", use_cpu=True)
    assert made.bf16 is True and made.sp_size == 1


def test_grpo_group_trains_on_the_first_ranks_completions(runs):
    """Rank 1 samples other completions (a diverging RNG stream); the group trains on rank 0's, so both
    ranks saw the same completions and the run equals one process (checked above for this case)."""
    _, ranks = _pair(runs, 2, "grpo-llama-grpo/sp2/diverging-samples")
    assert ranks[0]["completions"] == ranks[1]["completions"] and ranks[0]["completions"]


def test_sft_packed_rows_use_the_balanced_layout(runs):
    _, ranks = _pair(runs, 2, "sft-llama-packed/sp2")
    assert {r["layout"] for r in ranks} == {"balanced"}
