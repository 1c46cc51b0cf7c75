# The performance grid with interleaved rounds (benchmarks/README.md), from the repository root
# with the project installed: bash benchmarks/results/rounds-grid.sh
export OMP_NUM_THREADS=1
R=benchmarks/results
run() { echo "=== $(date -u +%H:%M:%S) $*"; sp-bench run --repeat 5 --peers deepspeed,torch-ring "$@"; }
for dt in float32 bfloat16; do
  d=${dt/float32/fp32}; d=${d/bfloat16/bf16}
  run --nproc 2 --seq 4k --heads 8 --kv-heads 8,2 --dtype $dt --json $R/rounds-P2-$d-4k-H8.json
  run --nproc 2 --seq 4k --heads 16 --kv-heads 1 --dtype $dt --json $R/rounds-P2-$d-4k-H16KV1.json
  run --nproc 2 --seq 8k,16k --heads 8 --kv-heads 8,2 --dtype $dt --no-baseline --json $R/rounds-P2-$d-8k16k-H8.json
  run --nproc 2 --seq 8k,16k --heads 16 --kv-heads 1 --dtype $dt --no-baseline --json $R/rounds-P2-$d-8k16k-H16KV1.json
done
for dt in float32 bfloat16; do
  d=${dt/float32/fp32}; d=${d/bfloat16/bf16}
  run --nproc 4 --seq 4k,8k,16k --heads 8 --kv-heads 8,2 --dtype $dt --no-baseline --json $R/rounds-P4-$d-H8.json
  run --nproc 4 --seq 4k,8k,16k --heads 16 --kv-heads 1 --dtype $dt --no-baseline --json $R/rounds-P4-$d-H16KV1.json
done
echo "=== done $(date -u +%H:%M:%S)"
