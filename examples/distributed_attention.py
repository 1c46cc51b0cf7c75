"""DeepSpeed-Ulysses' ``DistributedAttention`` call on ulysses-sp, checked against whole-sequence attention:

    torchrun --nproc_per_node 2 examples/distributed_attention.py

It ends without ``dist.destroy_process_group()``, as many DeepSpeed scripts do: on gloo, ulysses-sp
destroys the process groups at a clean exit (benchmarks/clean_exit.py --job distributed-attention).
"""

import torch
import torch.distributed as dist

import ulysses_sp as usp
from ulysses_sp.integrations.deepspeed import DistributedAttention


def local_attention(q, k, v):  # whole sequences, heads / P heads, [s, b, h, d]
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / q.shape[-1] ** 0.5
    causal = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril()
    return torch.einsum("bhst,tbhd->sbhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v)


torch.set_num_threads(1)
dist.init_process_group("gloo")
topo = usp.init_sequence_parallel(sp_size=dist.get_world_size(), layout="contiguous")
torch.manual_seed(0)  # the same whole sequence on every rank
q, k, v = (torch.randn(16 * topo.sp_size, 1, 4, 8) for _ in range(3))
mine = slice(16 * topo.sp_rank, 16 * (topo.sp_rank + 1))  # this rank's contiguous 16 tokens
out = DistributedAttention(local_attention, topo.sp_group)(q[mine], k[mine], v[mine], batch_dim_idx=1)
error = (out - local_attention(q, k, v)[mine]).abs().max().item()
print(f"rank {topo.rank}: largest difference from whole-sequence attention {error:.1e}")
assert error < 1e-5
