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
