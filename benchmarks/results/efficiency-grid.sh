# The efficiency target's cells (4k, P = 2), T1 paired in the rounds, timed under glibc's mmap
# threshold at 128 KiB (the memory probe's setting, which sp-bench used to time under: "probe")
# and under the allocator's defaults, alternating (benchmarks/README.md). From the repository
# root with the project installed: bash benchmarks/results/efficiency-grid.sh
export OMP_NUM_THREADS=1
R=benchmarks/results
run() { echo "=== $(date -u +%H:%M:%S) $*"; sp-bench run --nproc 2 --seq 4k --backends ulysses,allgather,ring,hybrid --repeat 11 --no-memory "$@"; }
for dt in float32 bfloat16; do
  d=${dt/float32/fp32}; d=${d/bfloat16/bf16}
  for hkv in "8 8,2 H8" "16 1 H16KV1"; do
    set -- $hkv
    MALLOC_MMAP_THRESHOLD_=131072 run --heads $1 --kv-heads $2 --dtype $dt --json $R/efficiency-probe-P2-$d-4k-$3.json
    run --heads $1 --kv-heads $2 --dtype $dt --json $R/efficiency-P2-$d-4k-$3.json
  done
done
echo "=== done $(date -u +%H:%M:%S)"
