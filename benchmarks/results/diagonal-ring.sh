# Our ring against torch's ring at 8/8 after the own block became one causal call (benchmarks/README.md),
# 7 rounds, timed under the allocator's defaults. From the repository root: bash benchmarks/results/diagonal-ring.sh
export OMP_NUM_THREADS=1
R=benchmarks/results
for p in 2 4; do
  for dt in float32 bfloat16; do
    d=${dt/float32/fp32}; d=${d/bfloat16/bf16}
    echo "=== $(date -u +%H:%M:%S) P=$p $dt"
    sp-bench run --nproc $p --seq 4k,8k --heads 8 --kv-heads 8 --dtype $dt --backends ring --peers torch-ring --repeat 7 \
        --no-memory --no-baseline --json $R/diagonal-ring-P$p-$d-4k8k-H8KV8.json
  done
done
echo "=== done $(date -u +%H:%M:%S)"
