"""Expert parallelism (holotrain/parallel/ep.py): the token exchange and a mixture-of-experts model trained under
parallel.ep on gloo ranks against one process, checkpoints resharded across ep degrees; the config's refusals."""

import pytest

from holotrain.config import load_config, resolve
from holotrain.errors import ConfigError
from holotrain.parallel.dims import ParallelDims
from tests.conftest import run_worker


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4])
def test_expert_parallel_equals_one_process(ranks):
    """tests/ep_worker.py: the exchange (uneven counts, an empty expert) gives one process's outputs and gradients;
    a Qwen3-MoE model with the trainer's AdamW and clipping gives one process's losses over 8 steps of packed
    documents and its first gradients at ep=2 (2 ranks), ep=4 and dp=2 x ep=2 (4 ranks), and the dp=2 x ep=2
    checkpoint of step 4 resumes at ep=4 and ep=1 with the same losses."""
    run_worker("ep_worker.py", ranks, f"EP OK world={ranks}")


MOE = ["--model.family=qwen3_moe", "--model.preset=tiny", "--job.device=cpu"]


@pytest.mark.parametrize("args, message", [
    (["--parallel.ep=2"], "parallel.ep = 2 splits a mixture-of-experts model's experts; this llama model is dense"),
    ([*MOE, "--parallel.ep=3"], "parallel.ep = 3 must divide model.n_experts = 8"),
    ([*MOE, "--parallel.ep=2", "--parallel.cp=2"], "parallel.ep = 2 does not combine with parallel.cp = 2 yet"),
    ([*MOE, "--parallel.ep=2", "--parallel.pp=2", "--model.tie_embeddings=false"],
     "parallel.ep = 2 does not combine with parallel.pp = 2 yet"),
    ([*MOE, "--parallel.ep=0"], "parallel.ep must be >= 1, got 0"),
])
def test_config_refuses_what_expert_parallelism_cannot_run(args, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        resolve(load_config(None, args))


def test_layout_holds_the_expert_groups():
    dims = ParallelDims(world=8, ep=2)
    assert (dims.dp, dims.ep, dims.expert_dp) == (8, 2, 4)
    with pytest.raises(ConfigError, match="launch with torchrun --nproc_per_node=2"):
        ParallelDims(world=1, ep=2)
    with pytest.raises(ConfigError, match=r"parallel.ep=4 must divide the data-parallel ranks \(6\)"):
        ParallelDims(world=6, ep=4)
