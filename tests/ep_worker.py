"""Run by tests/test_ep.py under torchrun (gloo): expert parallelism's dispatch and combine against one process's
computation. Each rank routes its own tokens (uneven counts, some experts empty) to E experts of which it holds
E / world; outputs and the gradients of the tokens and of its experts' weights must equal the same computation done
with every expert on every rank."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from holotrain.parallel.ep import combine, dispatch  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    E, D = 8, 16
    torch.manual_seed(0)
    weights = torch.randn(E, D, D, dtype=torch.float64)  # the same on every rank
    local = E // world
    mine = weights[rank * local:(rank + 1) * local].clone().requires_grad_(True)

    g = torch.Generator().manual_seed(100 + rank)
    n = 5 + 7 * rank
    experts = torch.randint(0, E, (n,), generator=g)
    experts[experts == 3] = 2  # expert 3 gets no token from any rank
    experts, _ = experts.sort()
    x = torch.randn(n, D, dtype=torch.float64, generator=g, requires_grad=True)
    counts = torch.bincount(experts, minlength=E)

    rows, local_counts, how = dispatch(x, counts, None)
    parts = [r @ w for r, w in zip(rows.split(local_counts.tolist()), mine)]
    y = combine(torch.cat(parts), how, None)
    upstream = torch.randn(n, D, dtype=torch.float64, generator=g)
    (y * upstream).sum().backward()

    full = weights.clone().requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = torch.einsum("nd,nde->ne", x_ref, full[experts])
    (y_ref * upstream).sum().backward()
    dist.all_reduce(full.grad)  # every rank's tokens' contribution to each expert
    assert torch.allclose(y, y_ref, atol=1e-12), (y - y_ref).abs().max()
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-12)
    assert torch.allclose(mine.grad, full.grad[rank * local:(rank + 1) * local], atol=1e-12)
    if rank == 0:
        print(f"EP OK world={world}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
