"""`holotrain generate` and the decoder's KV-cache decoding: greedy continuations equal transformers' generate() for
every family (Mistral's window reached), the cache equals recomputing the whole sequence, sampling is seeded and
filtered, and chat prompts render with the template. A trained run on the command line: tests/test_export_generate.py."""

import pytest
import torch

from tests.hf_models import VOCAB, make_hf_model

PROMPT = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1)).tolist()[0]


@pytest.mark.parametrize("kind", ["llama3.2", "qwen2.5", "qwen3", "mistral"])
def test_greedy_decoding_with_the_cache_equals_transformers(kind, tmp_path):
    from holotrain.generate import Sampling, load

    hf = make_hf_model(tmp_path, kind)
    hf.generation_config.eos_token_id = None  # run every step: no early stop on either side
    gen = load(tmp_path, device="cpu")
    gen.stop_ids = []
    new = gen.continue_ids(PROMPT, Sampling(max_new_tokens=40))
    want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=40, do_sample=False, min_new_tokens=40)[0, 40:]
    assert new == want.tolist()  # 80 positions: past Mistral's window of 64
    # The cache equals recomputing the whole sequence each step.
    with torch.no_grad():
        ids = list(PROMPT)
        for _ in range(8):
            ids.append(int(gen.model(torch.tensor([ids]))[0, -1].argmax()))
    assert ids[40:] == new[:8]
    # A step with its position on the device (what a CUDA graph of the step captures: the whole cache attended under
    # the mask, the keys and values written at that position) gives the counted step's logits, past the window too.
    from holotrain.model.kvcache import KVCache

    counted, positioned = (KVCache(gen.model.args, 1, 80, torch.device("cpu"), torch.float32) for _ in range(2))
    with torch.no_grad():
        for cache in (counted, positioned):
            gen.model.decode(torch.tensor([PROMPT]), cache)
        for token in new[:39]:
            want = gen.model.decode(torch.tensor([[token]]), counted)
            got = gen.model.decode(torch.tensor([[token]]), positioned, position=torch.tensor(positioned.length))
            positioned.length += 1
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (token, (got - want).abs().max())
    assert counted.length == positioned.length == 79


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_decode_steps_replayed_from_a_cuda_graph_equal_the_eager_steps(tmp_path):
    from holotrain.generate import Sampling, load
    from holotrain.model.kvcache import KVCache, TokenSteps, graphable

    make_hf_model(tmp_path, "mistral")
    gen = load(tmp_path, device="cuda")
    gen.stop_ids = []
    assert graphable(gen.model)
    runs = []
    for graph in (False, True):
        cache = KVCache(gen.model.args, 2, 64, torch.device("cuda"), next(gen.model.parameters()).dtype)
        prompt = torch.tensor([PROMPT[:20], PROMPT[20:]], device="cuda")
        logits, steps, tokens = gen.model.decode(prompt, cache), TokenSteps(gen.model, cache, graph=graph), []
        for _ in range(40):
            tokens.append(logits[:, -1].float().argmax(-1))
            logits = steps.step(tokens[-1][:, None])
        assert not steps.fallback and (steps.graph is not None) == graph
        runs.append(torch.stack(tokens, 1).tolist())
    assert runs[0] == runs[1]
    assert gen.continue_ids(PROMPT, Sampling(max_new_tokens=30)) == gen.continue_ids(PROMPT, Sampling(max_new_tokens=30))


def test_sampling_is_seeded_filtered_and_stops(tmp_path):
    from holotrain.errors import ConfigError
    from holotrain.generate import Sampling, load, pick

    make_hf_model(tmp_path, "qwen3")
    gen = load(tmp_path, device="cpu")
    gen.stop_ids = []
    a = gen.continue_ids(PROMPT, Sampling(max_new_tokens=12, temperature=1.0, top_k=20, top_p=0.9, seed=3))
    assert a == gen.continue_ids(PROMPT, Sampling(max_new_tokens=12, temperature=1.0, top_k=20, top_p=0.9, seed=3))
    assert a != gen.continue_ids(PROMPT, Sampling(max_new_tokens=12, temperature=1.0, top_k=20, top_p=0.9, seed=4))
    logits = torch.tensor([0.0, 5.0, 4.9, -1.0])
    rng = torch.Generator().manual_seed(0)
    assert {pick(logits, Sampling(temperature=1.0, top_k=2), rng) for _ in range(200)} == {1, 2}
    assert {pick(logits, Sampling(temperature=1.0, top_p=0.3), rng) for _ in range(50)} == {1}
    j = next(i for i in range(1, len(a)) if a[i] not in a[:i])  # the first token not sampled before it
    gen.stop_ids = [a[j]]
    assert gen.continue_ids(PROMPT, Sampling(max_new_tokens=12, temperature=1.0, top_k=20, top_p=0.9, seed=3)) == a[:j]
    with pytest.raises(ConfigError, match="--top-p must be in"):
        gen.continue_ids(PROMPT, Sampling(top_p=0))


def test_chat_prompt_renders_with_the_template(tmp_path):
    from holotrain.generate import load

    make_hf_model(tmp_path, "qwen2.5")
    gen = load(tmp_path, device="cpu")
    ids = gen.encode("what is 2?", chat=True, system="be brief")
    text = gen.tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nbe brief<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    assert gen.tokenizer.token_to_id("<|im_end|>") in gen.stop_ids  # the end of an assistant turn stops it
