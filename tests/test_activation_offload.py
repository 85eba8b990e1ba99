"""memory.activation_offload_blocks: the first blocks' saved tensors wait in host memory between forward and
backward. On the CPU the same bookkeeping copies to host buffers and back, so training must be bit for bit the same;
on a GPU (skipped without one) the copies run on streams of their own and the peak falls."""

import pytest
import torch
from conftest import read_metrics, tiny_args

from holotrain.memory.activation_offload import ActivationOffload
from holotrain.model import ModelArgs, build

ARGS = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=176, vocab_size=256, max_seq_len=32)


def _grads(model, batches, offload=None):
    model.zero_grad(set_to_none=True)
    model.hooks.install("run_blocks", offload, "memory")
    losses = []
    for tokens in batches:  # gradient accumulation: the host buffers are reused by the next micro-batch
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        losses.append(loss.item())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("compiled", [False, True])
def test_offloaded_blocks_give_the_same_gradients(compiled):
    torch.manual_seed(0)
    model = build(ARGS)
    if compiled:
        for block in model.layers.values():
            block.compile()
    batches = [torch.randint(0, ARGS.vocab_size, (2, 33)) for _ in range(2)]
    want_losses, want = _grads(model, batches)
    offload = ActivationOffload(2, ARGS.n_layers, torch.device("cpu"), min_bytes=0)
    got_losses, got = _grads(model, batches, offload)
    assert got_losses == want_losses
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert offload.host_bytes > 0
    assert {key[0] for key in offload._slots} == {0, 1}, "blocks 0 and 1 only"
    assert not any(offload._packed.values()), "every offloaded tensor came back"
    # A second step reuses the host buffers.
    buffers = {key: slot.host.data_ptr() for key, slot in offload._slots.items()}
    again_losses, again = _grads(model, batches, offload)
    assert again_losses == want_losses and all(torch.equal(again[n], want[n]) for n in want)
    assert {key: slot.host.data_ptr() for key, slot in offload._slots.items()} == buffers


@pytest.mark.parametrize("compiled", [False, True])
def test_checkpointed_blocks_offload_their_inputs_alone(compiled):
    """With every block recomputed ("full"), an offloaded block keeps only its input on the host: B x T x dim values
    a block (the rotary tables and the mask, every block's, stay put), as the memory plan counts them, and the
    gradients are those of checkpointing alone, bit for bit."""
    from holotrain.config import load_config, resolve
    from holotrain.memory.activation_checkpointing import apply_activation_checkpointing
    from holotrain.memory.plan import activations

    torch.manual_seed(0)
    model = build(ARGS)
    apply_activation_checkpointing(model, "full")
    if compiled:
        model.compile_regions()
    batches = [torch.randint(0, ARGS.vocab_size, (2, 33)) for _ in range(2)]
    doc_ids = (torch.arange(32) >= 20).long().expand(2, 32)  # packed rows: per-token rotary tables, a mask
    want_losses, want = _grads(model, batches)
    # Every tensor, but for the CPU generator's state (5,056 bytes) that a compiled checkpoint saves (a GPU's: 16).
    offload = ActivationOffload(2, ARGS.n_layers, torch.device("cpu"), min_bytes=8192 if compiled else 0)
    got_losses, got = _grads(model, batches, offload)
    assert got_losses == want_losses and all(torch.equal(got[n], want[n]) for n in want)
    assert offload.host_bytes == 2 * 2 * 32 * ARGS.dim * 4, [s.host.shape for s in offload._slots.values()]
    model.hooks.install("run_blocks", offload, "memory")
    model(batches[0][:, :-1], batches[0][:, 1:], doc_ids).backward()
    assert offload.host_bytes == 2 * 2 * 32 * ARGS.dim * 4, [s.host.shape for s in offload._slots.values()]
    # With the feed-forwards tiled too (the long-sequence set "auto" picks): the same gradients, the same host bytes.
    model.tile_feed_forward(4)
    tiled_losses, tiled = _grads(model, batches, offload)
    assert tiled_losses == pytest.approx(want_losses, abs=1e-6)
    assert all(torch.allclose(tiled[n], want[n], atol=1e-6, rtol=1e-5) for n in want)
    assert offload.host_bytes == 2 * 2 * 32 * ARGS.dim * 4

    cfg = resolve(load_config(None, ["--model.dim=64", "--model.n_layers=3", "--model.n_heads=4", "--model.n_kv_heads=2",
                                     "--model.ffn_dim=176", "--data.seq_len=32", "--training.batch_size=2",
                                     "--training.dtype=fp32", "--memory.activation_checkpointing=full",
                                     "--memory.activation_offload_blocks=2"]), tokenizer_vocab=256)
    assert activations(cfg, 2, 4, 0, attention_probs=True).offloaded == offload.host_bytes


class _SavesMaskIndices(torch.autograd.Function):
    """What a compiled block with flex attention does: its backward keeps the BlockMask's index tensors (graph
    inputs, every block's) beside the block's own values."""

    @staticmethod
    def forward(ctx, h, kv_indices, q_indices):
        ctx.save_for_backward(h, kv_indices, q_indices)
        return h * 2

    @staticmethod
    def backward(ctx, grad):
        h, kv_indices, q_indices = ctx.saved_tensors
        assert kv_indices.shape == q_indices.shape
        return grad * 2, None, None


def test_a_block_masks_tensors_stay_put():
    """The document mask's BlockMask is every block's, like the rotary tables: its tensors are not copied out per
    block (at T = 1M its four index tensors are 1.07 GB, which 22 offloaded blocks would have copied 22 times)."""
    from torch.nn.attention.flex_attention import create_block_mask

    mask = create_block_mask(lambda b, h, q, k: q >= k, 1, None, 1024, 1024, device="cpu")
    block = lambda h, mask: _SavesMaskIndices.apply(h, mask.kv_indices, mask.q_indices)  # noqa: E731
    h = torch.randn(1, 1024, 8, requires_grad=True)
    offload = ActivationOffload(2, 2, torch.device("cpu"), min_bytes=0)
    out = offload([(0, block), (1, block)], h, mask)
    out.sum().backward()
    assert offload.host_bytes == 2 * h.numel() * 4, [s.host.shape for s in offload._slots.values()]
    assert torch.equal(h.grad, torch.full_like(h, 4.0))


def test_the_memory_plan_moves_offloaded_activations_to_the_host():
    from holotrain.config import find_config, load_config, resolve
    from holotrain.memory.plan import OFFLOADED_ACTIVATIONS, plan_memory
    from holotrain.train.resolve import model_args

    def plan(blocks):
        cfg = resolve(load_config(find_config("1.4b"), ["--training.batch_size=16",
                                                        f"--memory.activation_offload_blocks={blocks}"]))
        with torch.device("meta"):
            model = build(model_args(cfg))
        return plan_memory(model, cfg, 1, torch.device("cuda"), 16, 1, gpu_capacity=140e9, host_capacity=100e9)

    none, three = plan(0), plan(3)
    moved = none.gpu["activations (estimate)"] - three.gpu["activations (estimate)"]
    assert moved == pytest.approx(3 / 24 * (none.gpu["activations (estimate)"] - 0), rel=0.2)
    assert three.host[OFFLOADED_ACTIVATIONS] == pytest.approx(moved)
    assert three.pinned == pytest.approx(moved)
    assert 5e9 < moved < 8e9  # about 2.2 GB a block at 16 x 2048 tokens (measured on the H200)


def test_more_offloaded_blocks_than_the_model_has_is_a_config_error(tmp_path):
    from conftest import run_cli_here

    proc = run_cli_here("train", *tiny_args(tmp_path, **{"memory.activation_offload_blocks": 3}))
    assert proc.returncode == 2 and "memory.activation_offload_blocks" in proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_offloaded_blocks_lower_the_peak_and_keep_the_gradients():
    """The 1.4b's block shape, 16 blocks, the first 2 offloaded: a block's copy out (about 0.5 GB) takes several
    blocks' forward, so the memory is free at the end of forward only when the copies run beside the compute as
    they should. The gradients match training without offload up to the GPU's nondeterminism: attention's backward
    accumulates in no fixed order, and one rounding changed in a bf16 block carries on through the blocks below (on
    an H200 the offloaded run differed by up to 0.33% of a gradient's norm, in blocks the offload does not touch
    too). A wrong or unfinished copy changes the offloaded blocks' gradients wholesale."""
    args = ModelArgs(dim=2048, n_layers=16, n_heads=16, n_kv_heads=16, ffn_dim=5632, vocab_size=4096,
                     max_seq_len=2048)
    torch.manual_seed(0)
    model = build(args).cuda()
    for block in model.layers.values():
        block.compile()
    batches = [torch.randint(0, args.vocab_size, (4, 2049), device="cuda") for _ in range(2)]

    def run(offload):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _grads(model, batches, offload)  # compiles, fills the host buffers
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()  # the earlier runs' gradients, still held, are not this run's
            out = _grads(model, batches, offload)
        torch.cuda.synchronize()
        return out, torch.cuda.max_memory_allocated() - before

    def error(a, b):
        return ((a - b).norm() / b.norm()).item()

    (want_losses, want), plain_peak = run(None)
    offload = ActivationOffload(2, args.n_layers, torch.device("cuda"))
    (got_losses, got), offload_peak = run(offload)
    assert got_losses == pytest.approx(want_losses, abs=1e-6)
    for name in want:
        assert error(got[name], want[name]) < 2e-2, name
    per_block = offload.host_bytes / 2
    assert per_block > 0.4e9
    assert offload_peak < plain_peak - per_block, (plain_peak / 1e9, offload_peak / 1e9, per_block / 1e9)


def test_copy_exposure_and_the_plans_choices():
    """The copies back are hidden while the blocks above take longer than them; a setting whose copies out outlast
    the forward does not fit (its memory would not be free at the peak). The plan offers the first eighth and
    quarter of the blocks without activation checkpointing, and with "full" any number up to all (their inputs), without
    optimizer offload, on a GPU."""
    from holotrain.memory.activation_offload import BACK_BYTES_S, exposed_copy_s
    from holotrain.plan.cost import Calibration, Machine, predict, with_settings
    from holotrain.plan.planner import enumerate_candidates, job_config
    from holotrain.train.resolve import model_args

    block = 2.2e9  # the 1.4b at 16 x 2048 tokens: forward ~0.14 s, backward ~0.28 s on the H200
    assert exposed_copy_s(3 * block, 3, 24, 0.14, 0.28) == 0.0
    six, twelve = exposed_copy_s(6 * block, 6, 24, 0.14, 0.28), exposed_copy_s(12 * block, 12, 24, 0.14, 0.28)
    assert 0 < six < twelve
    # Slow enough blocks hide any copy; every block offloaded waits for each copy back at least once.
    assert exposed_copy_s(12 * block, 12, 24, 10.0, 20.0) == 0.0
    assert exposed_copy_s(24 * block, 24, 24, 10.0, 20.0) >= block / BACK_BYTES_S

    gpu = Machine("cuda", "H200", 141e9, 134e9, 120e9, 660e12, 989e12, 5e9, 45e9, 700.0, True)
    cfg = job_config("1.4b", ["--training.batch_size=16"])
    cands = enumerate_candidates(cfg, gpu)
    moved = [c for c in cands if c.settings["memory.activation_offload_blocks"]]
    plain = {c.settings["memory.activation_offload_blocks"] for c in moved
             if c.settings["memory.activation_checkpointing"] == "none"}
    inputs = {c.settings["memory.activation_offload_blocks"] for c in moved
              if c.settings["memory.activation_checkpointing"] == "full"}
    assert plain == {3, 6} and inputs == {3, 6, 12, 18, 24}
    assert all(not c.settings["memory.offload"] and (c.settings["memory.activation_checkpointing"] == "none"
                                                     or (c.settings["memory.activation_checkpointing"] == "full"
                                                         and not c.settings["memory.activation_checkpointing_blocks"]))
               for c in moved)
    assert any("activations of 3 blocks on the host" in c.label for c in moved)
    # At T = 2048 no feed-forward is tiled (TILE_TOKENS).
    assert all(c.settings["memory.ffn_tiles"] == 1 for c in cands)
    cpu = Machine("cpu", "test", None, None, 16e9, 50e9, None, 1e8, 5e9, None, False)
    assert not any(c.settings["memory.activation_offload_blocks"] for c in enumerate_candidates(cfg, cpu))

    with torch.device("meta"):
        model = build(model_args(cfg))

    def run(blocks):
        return predict(model, with_settings(cfg, {"memory.activation_offload_blocks": blocks}), gpu, Calibration(),
                       16, 1)

    none, two, twelve = run(0), run(2), run(12)
    assert two.fits and none.gpu_bytes - two.gpu_bytes == pytest.approx(2 / 24 * 52e9, rel=0.15)
    assert two.phases["activation_offload"] == 0.0 and "activation_offload" not in none.phases
    assert not twelve.fits and "outlast the forward" in twelve.why_not


@pytest.mark.slow
def test_offload_under_fsdp_over_two_processes_trains_the_same(tmp_path):
    """FSDP2's gathered weights are parameters, which stay where they are; the blocks' own saved tensors go to host
    memory and back, so two gloo ranks train bit for bit as they do without offload. Also the config's way in:
    `holotrain train` with memory.activation_offload_blocks says what the host keeps."""
    from tests.test_distributed import torchrun

    size = {"model.dim": 256, "model.ffn_dim": 704, "data.seq_len": 128, "training.steps": 3, "checkpoint.every": 0,
            "checkpoint.save_final": False}
    plain = tmp_path / "plain"
    torchrun(2, "train", *tiny_args(plain, **size))
    out = torchrun(2, "train", *tiny_args(tmp_path / "offload", **size, **{"memory.activation_offload_blocks": 1}))
    assert "blocks 0-0 keep" in out and " 0 saved tensors" not in out, out[-2000:]
    assert [r["loss"] for r in read_metrics(tmp_path / "offload")] == [r["loss"] for r in read_metrics(plain)]
