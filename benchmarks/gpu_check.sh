#!/usr/bin/env bash
# GPU checks for ulysses-sp, run as is on a machine with one or more NVIDIA GPUs:
#
#     bash benchmarks/gpu_check.sh [ARGS for benchmarks/gpu_check.py]
#
# Installs the package (and flash-attn if it is missing and installs in time), prints the
# versions, runs benchmarks/gpu_check.py, then the main job for 20 bf16 steps on one GPU (and on
# real data with its resume, fp16 with its overflow steps counted, --engine fsdp2 in bf16 and a tiny image-text model) and, with 2+ GPUs,
# with SP=2 on two with the memory stack on (--tiled-loss --tiled-mlp --checkpoint offload) and on the image-text model, the Trainer on two (DDP, FSDP2) against one, the NCCL parity, sp-bench run (--check)
# and sp-bench calibrate under torchrun (its profile is left in the logs). One summary line per check: "PASS name ...",
# "FAIL name ..." or "SKIP name ..." (not a failure). Exit status 1 if any check failed,
# 0 otherwise; without nvidia-smi or without a GPU it prints "SKIP no GPU" and exits 0.
#
# Whole run at most GPU_CHECK_BUDGET seconds (default 570, under 10 minutes); every step runs
# under `timeout`, capped by what is left. Logs go to GPU_CHECK_LOGS (default
# $OUT/gpu_check_logs when $OUT is set, else /tmp/gpu_check_logs). PYTHON picks the interpreter.

set -u

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

PYTHON=${PYTHON:-python}
BUDGET=${GPU_CHECK_BUDGET:-570}
LOGS=${GPU_CHECK_LOGS:-${OUT:+$OUT/gpu_check_logs}}
LOGS=${LOGS:-/tmp/gpu_check_logs}
mkdir -p "$LOGS"

passed=0
failed=0
skipped=0

pass() { echo "PASS $*"; passed=$((passed + 1)); }
fail() { echo "FAIL $*"; failed=$((failed + 1)); }
skip() { echo "SKIP $*"; skipped=$((skipped + 1)); }

# seconds left of the budget, less a reserve for the summary
left() { echo $((BUDGET - SECONDS - 5)); }

# cap WANTED seconds by what is left after RESERVE seconds kept for the checks still to come
cap() {
    local wanted=$1 reserve=${2:-0} rest
    rest=$(($(left) - reserve))
    if ((rest < wanted)); then wanted=$rest; fi
    if ((wanted < 0)); then wanted=0; fi
    echo "$wanted"
}

# the last line of a log that says something, shortened (for the summary lines)
last_line() { grep -v '^[[:space:]]*$' "$1" 2>/dev/null | tail -n 1 | cut -c1-200; }

# run_logged NAME SECONDS RESERVE CMD...: the command under timeout (SECONDS at most, leaving
# RESERVE of the budget), its output in $LOGS/NAME.log; sets RC (124/137: timed out, 125: not
# started for want of time) and LIMIT
run_logged() {
    local name=$1
    LIMIT=$(cap "$2" "$3")
    shift 3
    if ((LIMIT < 10)); then
        RC=125
        echo "(not started: too little of the ${BUDGET} s budget left)" >"$LOGS/$name.log"
        return
    fi
    timeout --kill-after=15 "$LIMIT" "$@" >"$LOGS/$name.log" 2>&1
    RC=$?
}

# why a step that ran out of time failed, from RC
out_of_time() {
    if ((RC == 125)); then echo "not started: too little of the ${BUDGET} s budget left"; else echo "timed out after ${LIMIT} s"; fi
}
timed_out() { ((RC == 124 || RC == 125 || RC == 137)); }

# report NAME VERB OK [NOTE]: after run_logged NAME, "PASS NAME OK" when RC is 0, else VERB
# (fail or skip) with why: out of time, or the exit status and the log's last line; then NOTE
report() {
    local name=$1 verb=$2 ok=$3 note=${4:+ $4}
    if ((RC == 0)); then
        pass "$name $ok"
    elif timed_out; then
        $verb "$name $(out_of_time)$note"
    else
        $verb "$name rc=$RC: $(last_line "$LOGS/$name.log")$note"
    fi
}

# ---------------------------------------------------------------- GPUs present?
if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "SKIP no GPU (nvidia-smi not found)"
    exit 0
fi
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
if [[ -z "$NGPU" || "$NGPU" -lt 1 ]]; then
    echo "SKIP no GPU (nvidia-smi lists none)"
    exit 0
fi
echo "gpu_check: $NGPU GPU(s), budget ${BUDGET} s, logs in $LOGS"
nvidia-smi -L

# the least time kept for each later check while earlier ones run
R_VLM2=0
if ((NGPU >= 2)); then R_VLM2=60; fi  # the tiny image-text model at SP=2
R_TRAIN2=0
if ((NGPU >= 2)); then R_TRAIN2=$((130 + R_VLM2)); fi  # the memory stack at SP=2, then the image-text model
R_CAL=0
if ((NGPU >= 2)); then R_CAL=60; fi  # sp-bench calibrate under torchrun
R_BENCH=0
if ((NGPU >= 2)); then R_BENCH=$((60 + R_CAL)); fi  # sp-bench run under torchrun, then calibrate
R_PAR=0
if ((NGPU >= 2)); then R_PAR=$((150 + R_BENCH)); fi  # the NCCL parity, then sp-bench run and calibrate
R_HF=0
if ((NGPU >= 2)); then R_HF=180; fi  # the Trainer example: one GPU, two under DDP, two under FSDP2
R_RESUME=60  # its resume from the step-10 checkpoint
R_VLM=60  # the tiny image-text model on 1 GPU
R_FSDP2=$((60 + R_VLM))  # the job under --engine fsdp2 in bf16 (FSDP2's mixed precision on CUDA), then the image-text model
R_FP16=$((60 + R_FSDP2))  # fp16 from a loss scale of 2^32: the overflow steps DeepSpeed skips, counted in the metrics; then fsdp2
R_REAL=$((90 + R_RESUME + R_FP16))  # the real-data job on 1 GPU, then its resume, then fp16 and fsdp2
R_TRAIN1=$((100 + R_REAL + R_TRAIN2 + R_HF + R_PAR))
R_PY=$((150 + R_TRAIN1))
PIP=("$PYTHON" -m pip install --disable-pip-version-check --retries 1 --timeout 15)  # fail fast when offline

# ---------------------------------------------------------------- install
run_logged install 120 "$R_PY" "${PIP[@]}" -e ".[all]"
how="pip install -e .[all]"
if ((RC != 0)); then
    # offline or no build isolation possible: install the package alone over what is there
    mv "$LOGS/install.log" "$LOGS/install_all.log"
    run_logged install 90 "$R_PY" "${PIP[@]}" --no-deps --no-build-isolation -e .
    how="pip install --no-deps --no-build-isolation -e . (the [all] install failed: $(last_line "$LOGS/install_all.log"))"
fi
if ((RC == 0)) && ! "$PYTHON" -c "import ulysses_sp, ulysses_sp.backends, ulysses_sp.cli.main, deepspeed, transformers" >>"$LOGS/install.log" 2>&1; then
    RC=1
fi
report install fail "$how"

# ---------------------------------------------------------------- flash-attn (optional)
if "$PYTHON" -c "import flash_attn" >/dev/null 2>&1; then
    pass "flash_attn_install already importable"
else
    # a source build takes far longer than the budget; a prebuilt wheel installs in time
    run_logged flash_attn_install "${FLASH_ATTN_INSTALL_TIMEOUT:-120}" "$R_PY" "${PIP[@]}" flash-attn --no-build-isolation
    if ((RC == 0)) && ! "$PYTHON" -c "import flash_attn" >>"$LOGS/flash_attn_install.log" 2>&1; then
        RC=1
    fi
    report flash_attn_install skip installed "(flash-attn not importable: the flash_attn kernel is not checked)"
fi

# ---------------------------------------------------------------- versions
timeout 60 "$PYTHON" - <<'EOF' 2>&1 | tee "$LOGS/versions.log"
import torch
try:
    nccl = torch.cuda.nccl.version()
    nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
except Exception as e:  # noqa: BLE001
    nccl = f"? ({type(e).__name__})"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, NCCL {nccl}")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}")
for name in ("flash_attn", "deepspeed", "transformers"):
    try:
        module = __import__(name)
        print(f"{name} {getattr(module, '__version__', '?')}")
    except Exception as e:  # noqa: BLE001
        print(f"{name} not importable: {type(e).__name__}: {str(e)[:120]}")
EOF
if "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
    pass "torch_cuda torch sees $("$PYTHON" -c "import torch; print(torch.cuda.device_count())") GPU(s)"
else
    fail "torch_cuda torch.cuda.is_available() is False (a CPU build of torch?)"
fi

# ---------------------------------------------------------------- the Python checks
if [[ -f benchmarks/gpu_check.py ]]; then
    run_logged gpu_check_py 300 "$R_TRAIN1" "$PYTHON" benchmarks/gpu_check.py "$@"
    grep -E '^(PASS|FAIL|SKIP) ' "$LOGS/gpu_check_py.log" | sed 's/^/  /'  # its own lines; tracebacks stay in the log
    report gpu_check_py fail benchmarks/gpu_check.py
else
    fail "gpu_check_py benchmarks/gpu_check.py not found"
fi

# ---------------------------------------------------------------- the main job
# train NAME NPROC SECONDS RESERVE ARGS...: torchrun the trainer; PASS if it exits 0 and printed
# step 20 with a finite loss
train() {
    local name=$1 nproc=$2 limit=$3 reserve=$4
    shift 4
    run_logged "$name" "$limit" "$reserve" "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$nproc" train.py "$@"
    local log="$LOGS/$name.log" first lastl
    first=$(grep -Eo 'step +1 +loss [0-9.naif-]+' "$log" | head -n 1 | awk '{print $NF}')
    lastl=$(grep -Eo 'step +20 +loss [0-9.naif-]+' "$log" | tail -n 1 | awk '{print $NF}')
    local rate layers
    rate=$(grep -E 'step +20 +loss' "$log" | tail -n 1 | grep -Eo '[0-9]+ tokens/s( +MFU [0-9.]+%)?')
    layers=$(grep -Eo 'backend per layer: .*' "$log" | head -n 1)
    if timed_out; then
        fail "$name $(out_of_time) ($(last_line "$log"))"
    elif ((RC != 0)); then
        local why
        why=$(grep -E 'Error|error' "$log" | tail -n 1 | cut -c1-200)
        fail "$name rc=$RC: ${why:-$(last_line "$log")}"
    elif [[ -z "$lastl" ]]; then
        fail "$name exited 0 but printed no step 20"
    elif ! "$PYTHON" -c "import math, sys; sys.exit(0 if math.isfinite(float('$lastl')) else 1)" 2>/dev/null; then
        fail "$name loss $first -> $lastl (not finite)"
    else
        pass "$name loss $first -> $lastl at step 20, ${rate:-? tokens/s}${layers:+, $layers}"
    fi
}

train train_1gpu_bf16 1 240 "$((R_REAL + R_TRAIN2 + R_HF + R_PAR))" --sp-size 1 --steps 20 --dtype bf16
# a model directory with a tokenizer, JSON lines, the example DeepSpeed config (bf16 "auto": bf16 on CUDA),
# eval and the Hugging Face export, which must load with the engine's logits (checked on CPU by the tests)
"$PYTHON" -m ulysses_sp.testing.tiny_checkpoint "$LOGS/tiny" >/dev/null 2>&1 || fail "tiny_checkpoint could not write $LOGS/tiny"
real_args=(--sp-size 1 --model "$LOGS/tiny/model" --data "$LOGS/tiny/train.jsonl" --eval-data "$LOGS/tiny/eval.jsonl"
           --deepspeed examples/ds_config.json --seq-len 1024 --steps 20 --lr 1e-2 --metrics-file "$LOGS/tiny/metrics.jsonl"
           --export-hf "$LOGS/tiny/export" --save "$LOGS/tiny/ckpt" --save-every 10)
rm -rf "$LOGS/tiny/ckpt"  # a rerun's: a fresh run into checkpoints is refused
train train_1gpu_real_data 1 150 "$((R_RESUME + R_FP16 + R_TRAIN2 + R_HF + R_PAR))" "${real_args[@]}"
# the crash-safe checkpoints on CUDA (RNG states of the device included): the step-20 one removed, as if the run had
# died saving it; --resume latest must take step 10 and train to step 20 again
rm -rf "$LOGS/tiny/ckpt/step20"
train train_1gpu_resume 1 "$R_RESUME" "$((R_FP16 + R_TRAIN2 + R_HF + R_PAR))" "${real_args[@]}" --resume latest
grep -q -- '--resume: checkpoint step10 ' "$LOGS/train_1gpu_resume.log" || fail "train_1gpu_resume did not resume from step10"
# fp16 with DeepSpeed's dynamic loss scale started at 2^32 (its scale halves at each overflow): the first steps
# overflow and are skipped; the metrics file must count them (skipped_steps, which CPU runs cannot exercise)
echo '{"fp16": {"enabled": true, "initial_scale_power": 32}, "steps_per_print": 1000000}' >"$LOGS/ds_fp16_overflow.json"
rm -f "$LOGS/fp16_metrics.jsonl"
train train_1gpu_fp16_overflow 1 "$((R_FP16 - R_FSDP2))" "$((R_FSDP2 + R_TRAIN2 + R_HF + R_PAR))" --sp-size 1 --steps 20 \
    --deepspeed "$LOGS/ds_fp16_overflow.json" --metrics-file "$LOGS/fp16_metrics.jsonl"
verdict=$("$PYTHON" -c 'import json, sys
steps = [r for r in map(json.loads, open(sys.argv[1])) if "skipped_steps" in r]
n = steps[-1]["skipped_steps"] if steps else None
print(f"skipped_steps {n} of {len(steps)} steps in the metrics")
sys.exit(0 if steps and 0 < n < len(steps) else 1)' "$LOGS/fp16_metrics.jsonl" 2>&1) \
    && pass "fp16_skipped_steps $verdict" || fail "fp16_skipped_steps $verdict"
# the torch-native stack on CUDA: fully_shard, bf16 compute with fp32 reductions, DCP checkpoint written at the end
rm -rf "$LOGS/fsdp2_ckpt"  # a rerun's
train train_1gpu_fsdp2_bf16 1 60 "$((R_VLM + R_TRAIN2 + R_HF + R_PAR))" --sp-size 1 --steps 20 --dtype bf16 --engine fsdp2 \
    --save "$LOGS/fsdp2_ckpt"
rm -rf "$LOGS/fsdp2_ckpt"
# an image-text model directory (tiny LLaVA, its processor, JSON lines of generated images) in bf16, with its export
"$PYTHON" -m ulysses_sp.testing.tiny_checkpoint --vlm llava "$LOGS/tinyvlm" >/dev/null 2>&1 || fail "tiny_checkpoint --vlm could not write $LOGS/tinyvlm"
vlm_args=(--model "$LOGS/tinyvlm/model" --data "$LOGS/tinyvlm/train.jsonl" --eval-data "$LOGS/tinyvlm/eval.jsonl" --seq-len 512
          --steps 20 --lr 1e-2 --dtype bf16 --verify)
train train_1gpu_vlm 1 "$R_VLM" "$((R_TRAIN2 + R_HF + R_PAR))" --sp-size 1 "${vlm_args[@]}" --export-hf "$LOGS/tinyvlm/export"
if ((NGPU >= 2)); then
    # SP=2 with the memory stack on: tiled loss, tiled MLP, checkpoints offloaded to pinned host memory
    train train_2gpu_sp2_bf16_memory_stack 2 240 "$((R_VLM2 + R_HF + R_PAR))" --sp-size 2 --steps 20 --dtype bf16 --tiled-loss --tiled-mlp --checkpoint offload
    # the image-text model at SP=2: each image encoded on one GPU, its features sent over NCCL's uneven all-to-all; --verify first
    train train_2gpu_sp2_vlm 2 "$R_VLM2" "$((R_HF + R_PAR))" --sp-size 2 "${vlm_args[@]}"
    # SequenceParallelTrainer (DDP over NCCL, fp32) on 2 GPUs against the same script on one: losses and eval_loss
    hf_args=(examples/train_with_trainer.py --output_dir "$LOGS/hf" --max_steps 8 --learning_rate 1e-2 --logging_steps 1
             --report_to none --save_strategy no --disable_tqdm true --seq_len 256)
    run_logged trainer_1gpu 60 "$((120 + R_PAR))" "$PYTHON" "${hf_args[@]}" --sp_size 1 --results "$LOGS/hf1.json"
    report trainer_1gpu fail "the one-GPU reference ran"
    # trainer_on_2 NAME RESERVE ARGS...: the example on 2 GPUs (SP=2) against hf1.json: losses and eval_loss
    trainer_on_2() {
        local name=$1 reserve=$2
        shift 2
        run_logged "$name" 60 "$reserve" "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 2 "${hf_args[@]}" \
            --sp_size 2 --results "$LOGS/$name.json" "$@"
        verdict=""
        if ((RC == 0)); then
            verdict=$("$PYTHON" -c 'import json, sys
one, two = (json.load(open(p)) for p in sys.argv[1:])
loss = max(abs(a - b) for a, b in zip(one["losses"], two["losses"]))
ev, steps = abs(one["eval_loss"] - two["eval_loss"]), len(two["losses"])
print(f"max loss deviation {loss:.2e}, eval_loss deviation {ev:.2e} over {steps} steps against one GPU")
sys.exit(0 if loss < 1e-3 and ev < 1e-3 and two["world"] == 2 else 1)' "$LOGS/hf1.json" "$LOGS/$name.json" 2>&1) || RC=1
        fi
        report "$name" fail "$verdict" "$verdict"
    }
    trainer_on_2 trainer_2gpu_sp2 "$((60 + R_PAR))"
    trainer_on_2 trainer_2gpu_sp2_fsdp2 "$R_PAR" --fsdp full_shard  # accelerate's FSDP2 (the CPU tests force it; here accelerate chooses it)
    # every backend x layout x kernel on up to 4 GPUs with NCCL against one-process fp64 attention
    run_logged parity_nccl 150 "$R_BENCH" "$PYTHON" benchmarks/gpu_check.py --ranks 4
    grep -E '^(PASS|FAIL|INFO) ' "$LOGS/parity_nccl.log" | sed 's/^/  /'
    report parity_nccl fail "$(last_line "$LOGS/parity_nccl.log")"
    # sp-bench run on NCCL (the launched path): T1 on rank 0 in the rounds, the ring's own block in
    # one causal kernel call, every entry --check'ed against fp64 attention (fp32, where a wrong mask
    # stands out; the bf16 flash-attn calls are parity_nccl's), bytes against the estimate; a packed row (one 6k document,
    # then 512-token ones) under zigzag and balanced, whose ring and all-gather times say what balance buys on GPUs
    run_logged bench_nccl 60 "$R_CAL" "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 2 \
        -m ulysses_sp.cli.main run --seq 8k --heads 8 --kv-heads 8,2 --dtype float32 --backends ulysses,allgather,ring \
        --layout zigzag,balanced --docs 6k,512x4 --peers torch-ring --repeat 3 --check --json "$LOGS/bench-nccl.json"
    verdict=""
    if ((RC == 0)); then
        verdict=$("$PYTHON" -c 'import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"] if "skipped" not in r]
ours = [r for r in rows if r["kind"] != "peer"]
bad = [r["entry"] for r in rows if r["max_error"] > 1e-3] + [r["entry"] for r in ours if not (r["bytes_match"] and r["efficiency"] > 0)]
for r in rows:
    print(r["entry"], r["layout"], "work", round(r["work_imbalance"], 2), "KV" + str(r["kv_heads"]), round(1e3 * r["fwd_bwd_s"]["median"], 1),
          "ms eff", round(r.get("efficiency", 0), 2), end="; ")
print("bad:", bad)
sys.exit(1 if bad or not ours else 0)' "$LOGS/bench-nccl.json" 2>&1) || RC=1
    fi
    report bench_nccl fail "$verdict" "$verdict"
    # sp-bench calibrate on NCCL (the launched path; every backend auto weighs, hybrid-u2 on 4 GPUs): the
    # profile auto would use on these GPUs, in place of NVLINK_PROFILE's published figures
    ncal=2
    if ((NGPU >= 4)); then ncal=4; fi
    run_logged calibrate_nccl "$R_CAL" 0 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$ncal" \
        -m ulysses_sp.cli.main calibrate --repeat 3 --out "$LOGS/profile-${ncal}gpu.json"
    figures=$(grep -E '^(attention|backend overhead)' "$LOGS/calibrate_nccl.log" | tr '\n' ' ' | cut -c1-300)
    if timed_out; then
        skip "calibrate_nccl $(out_of_time)"
    else
        report calibrate_nccl fail "$LOGS/profile-${ncal}gpu.json: $figures"
    fi
    # TRL's DPO and GRPO trainers under SP=2 on NCCL (CUDA's fused LM head: TRL scores only the valid positions there),
    # with whatever budget is left: the CPU tests hold their exactness
    for trl in dpo grpo; do
        run_logged "trl_2gpu_sp2_$trl" 120 0 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 2 "examples/trl_$trl.py" \
            --sp_size 2 --output_dir "$LOGS/trl-$trl" --max_steps 3 --logging_steps 1 --report_to none --bf16 true
        report "trl_2gpu_sp2_$trl" fail "$(grep -E '^(reward margins|rewards):' "$LOGS/trl_2gpu_sp2_$trl.log" | tail -1)"
    done
else
    skip "train_2gpu_sp2_bf16_memory_stack, parity_nccl and calibrate_nccl need 2 GPUs, found $NGPU"
fi

# ---------------------------------------------------------------- summary
echo "gpu_check: $passed passed, $failed failed, $skipped skipped in ${SECONDS} s (logs: $LOGS)"
((failed == 0))
