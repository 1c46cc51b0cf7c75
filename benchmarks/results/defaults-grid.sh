# The grid at 4k and 8k again, timed under the allocator's defaults (--no-memory, as sp-bench
# now times every run), 5 rounds, nothing else running (benchmarks/README.md). From the
# repository root with the project installed: bash benchmarks/results/defaults-grid.sh
export OMP_NUM_THREADS=1
R=benchmarks/results
run() { echo "=== $(date -u +%H:%M:%S) $*"; sp-bench run --seq 4k,8k --peers deepspeed,torch-ring --repeat 5 --no-memory --no-baseline "$@"; }
for p in 2 4; do
  for dt in float32 bfloat16; do
    d=${dt/float32/fp32}; d=${d/bfloat16/bf16}
    run --nproc $p --dtype $dt --heads 8 --kv-heads 8 --json $R/defaults-P$p-$d-4k8k-H8KV8.json
    run --nproc $p --dtype $dt --heads 8 --kv-heads 2 --json $R/defaults-P$p-$d-4k8k-H8KV2.json
    run --nproc $p --dtype $dt --heads 16 --kv-heads 1 --json $R/defaults-P$p-$d-4k8k-H16KV1.json
  done
done
echo "=== done $(date -u +%H:%M:%S)"
