"""The config's [memory] section: activation checkpointing and offload, ZeRO-Offload, the optimizer's moments, the
loss in pieces, and the checks on its own keys."""

from __future__ import annotations

from dataclasses import dataclass

from holotrain.errors import ConfigError
from holotrain.section import Section, need


@dataclass
class MemoryConfig(Section):
    # "none" | "full" (every block recomputed in backward) | "selective" (every other block) | "pointwise" (the
    # norms, rotary and SwiGLU products recomputed, no matmul) | "all-but-attention" (every block recomputed but its
    # attention kernel, whose output is kept: long sequences); see holotrain/memory/activation_checkpointing.py.
    # true / false are accepted as "full" / "none". "auto": the least recomputation the memory plan fits (none at
    # short sequences, more as they grow), chosen when the run starts and saved in its config.toml; where "full"
    # alone does not fit, also ffn_tiles and activation_offload_blocks below (if left at 1 and 0).
    activation_checkpointing: str | bool = "auto"
    # "full", "pointwise" or "all-but-attention" on this many blocks, spread evenly over the depth (0 = every block).
    activation_checkpointing_blocks: int = 0
    # ZeRO-Offload (holotrain/memory/offload/): fp32 master weights and AdamW states in CPU memory, working
    # weights on the GPU in the compute dtype, the CPU step overlapped with backward and the next forward.
    offload: bool = False
    # Share of the parameters whose optimizer step runs on the CPU (the last units in forward order); the rest on the
    # GPU. "auto": the smallest share that the memory plan fits in GPU and host memory (the most work on the GPU).
    offload_ratio: float | str = 1.0
    # The CPU step's loops: "auto" (the compiled extension, holotrain/memory/offload/csrc; torch ops with a warning
    # where it cannot be built), "native" (the extension or an error) or "torch" (torch ops: more passes over memory).
    offload_kernel: str = "auto"
    offload_threads: int = 0  # CPU threads of the offloaded step; 0 = this rank's share of the cores, minus one
    # Python's GIL switch interval while the engine runs, in ms (0 = Python's 5 ms): the CPU worker takes the GIL back
    # a dozen times a bucket, and at 5 ms its native threads wait on the training thread's Python.
    offload_gil_switch_ms: float = 0.25
    # ZeRO-Offload's delayed parameter update (memory/offload/__init__.py; changes the optimization: never planned).
    # On one process it takes one micro-batch per step (the working weights change when a bucket's gradient lands).
    offload_delayed_update: bool = False
    adamw_moments: str = "fp32"  # on the device: fp32 | bf16 (4 bytes a parameter less; optim/bf16_moments.py)
    check_fit: bool = True  # refuse, before training starts, a plan that cannot fit GPU or host memory
    # The head and the loss fused, in pieces of this many tokens (model/head.py: one piece's fp32 logits alive).
    # 0 = auto: 8192 with activation checkpointing (memory first), else the whole micro-batch at once.
    loss_chunk_tokens: int = 0
    # The first this many blocks keep their saved tensors in pinned host memory between forward and backward
    # (memory/activation_offload.py): less GPU memory at the peak, no recompute, PCIe traffic instead. Under "full"
    # checkpointing what they keep is their input: the long-sequence use.
    activation_offload_blocks: int = 0
    # Each block's feed-forward runs the sequence in this many tiles, each recomputed in backward from its input
    # (Arctic's tiled MLP): gate, up and their product never held for the whole sequence. 1 = off.
    ffn_tiles: int = 1
    # With "full" on every block, only every k-th block's input is kept through the step; backward re-runs each
    # segment of k blocks from it (memory/activation_checkpointing.py). For sequences whose n_layers block inputs fit
    # neither the GPU nor the host. 1 = off.
    activation_checkpointing_segment: int = 1

    def check(self) -> None:
        """Also normalises what the section accepts in more than one spelling (activation_checkpointing = true,
        offload_ratio = "0.5"), so that the resolved config stores one. The block counts are bounded by
        model.n_layers: config_checks checks them."""
        # activation_checkpointing = true / false is accepted; the resolved config stores the policy name.
        ac = self.activation_checkpointing
        ac = {"true": "full", "false": "none"}.get(str(ac).lower(), ac) if isinstance(ac, (bool, str)) else ac
        need(ac in ("none", "full", "selective", "pointwise", "all-but-attention", "auto"),
             "memory.activation_checkpointing must be auto, none, full, selective, pointwise or all-but-attention, got "
             f"{self.activation_checkpointing!r}")
        self.activation_checkpointing = ac
        ratio = self.offload_ratio
        if isinstance(ratio, str) and ratio.strip().lower() == "auto":
            # Chosen with the memory plan when the model is built (train.trainer.build_model).
            self.offload_ratio = "auto"
        else:
            try:
                self.offload_ratio = float(ratio)
            except ValueError:
                raise ConfigError(f'memory.offload_ratio must be a number in [0, 1] or "auto", got {ratio!r}') from None
            need(0.0 <= self.offload_ratio <= 1.0, f"memory.offload_ratio must be in [0, 1], got {ratio}")
        need(self.offload_kernel in ("auto", "native", "torch"),
             f"memory.offload_kernel must be auto, native or torch, got {self.offload_kernel!r}")
        need(self.offload_threads >= 0, f"memory.offload_threads must be >= 0, got {self.offload_threads}")
        need(self.ffn_tiles >= 1, f"memory.ffn_tiles must be >= 1 (1: off), got {self.ffn_tiles}")
        k = self.activation_checkpointing_segment
        need(k >= 1, f"memory.activation_checkpointing_segment must be >= 1 (1: off), got {k}")
        need(k == 1 or (ac == "full" and not self.activation_checkpointing_blocks),
             f"memory.activation_checkpointing_segment = {k} re-runs blocks checkpointed whole: set "
             'memory.activation_checkpointing = "full" on every block (activation_checkpointing_blocks = 0)')
        need(k == 1 or not self.activation_offload_blocks,
             f"memory.activation_checkpointing_segment = {k} and memory.activation_offload_blocks = "
             f"{self.activation_offload_blocks} do not combine: keep segment inputs on the GPU or block inputs on the "
             "host, not both")
        need(self.offload_gil_switch_ms >= 0, f"memory.offload_gil_switch_ms must be >= 0 (0 = Python's own), got "
             f"{self.offload_gil_switch_ms}")
        need(self.offload or not self.offload_delayed_update,
             "memory.offload_delayed_update needs memory.offload = true")
        need(self.adamw_moments in ("fp32", "bf16"),
             f"memory.adamw_moments must be fp32 or bf16, got {self.adamw_moments!r}")
        need(not (self.offload and self.adamw_moments == "bf16"), "memory.adamw_moments = bf16 is for AdamW on the "
             "device; memory.offload keeps the moments in host memory in fp32")
        need(self.loss_chunk_tokens >= 0,
             f"memory.loss_chunk_tokens must be >= 0 (0 = auto), got {self.loss_chunk_tokens}")
