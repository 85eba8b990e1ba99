"""Long sequences on one GPU: memory.activation_checkpointing = "auto" recomputes only as much as the memory plan
needs (train/resolve.py)."""

import torch

from holotrain.config import load_config, resolve
from holotrain.memory.activation_checkpointing import recompute_share
from holotrain.parallel import DistEnv
from holotrain.train.resolve import checkpointing_choice


def test_auto_checkpointing_recomputes_only_at_long_sequences(capsys):
    gpu = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cuda"))
    chosen = {}
    for seq_len, batch in ((2048, 8), (131072, 1)):
        cfg = resolve(load_config("1.4b", [f"--data.seq_len={seq_len}", f"--training.batch_size={batch}"]),
                      tokenizer_vocab=32000)
        assert cfg.memory.activation_checkpointing == "auto"
        chosen[seq_len] = checkpointing_choice(cfg, gpu, batch, 1, gpu_capacity=140e9, host_capacity=100e9)
        # Too little memory for any choice: "full" on every block, which the memory check then refuses.
        assert checkpointing_choice(cfg, gpu, batch, 1, gpu_capacity=10e9, host_capacity=100e9) == ("full", 0)
    assert chosen[2048] == ("none", 0)
    policy, blocks = chosen[131072]
    assert recompute_share(policy, 24, blocks=blocks) > 0
    # The least recomputation: "full" on every block would fit too, and costs more.
    assert recompute_share(policy, 24, blocks=blocks) < recompute_share("full", 24)
    assert "memory.activation_checkpointing = auto -> none" in capsys.readouterr().out
