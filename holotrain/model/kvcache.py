"""Generation's state and its token loop: the keys and values of every layer (KVCache), and `TokenSteps`, which runs
the decoder one token a row at a time after the prompt (Decoder.decode).

At batch 1 a decode step of a 1B-parameter model is some 10 GFLOP and a few hundred small kernels, so its time is
the host launching them, not the GPU running them. On CUDA, TokenSteps therefore captures one step in a CUDA graph
and replays it for every later token: the step then takes its position from a device tensor and attends over every
cached position under a mask (the same shapes at every position), and the host only copies in the token and the
position and launches the graph."""

from __future__ import annotations

import torch

from holotrain.model.args import ModelArgs


class LayerCache:
    """One layer's keys and values [B, H_kv, capacity, D]: filled in order by `extend`, or at the device positions
    its KVCache's `writing` holds (a step with its position on the device)."""

    def __init__(self, owner: KVCache, k: torch.Tensor, v: torch.Tensor):
        self.owner, self.k, self.v = owner, k, v

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores these positions' keys and values; returns those of every position attended: the ones filled so
        far, or with `writing` set, the whole cache (the decoder's mask hides what is not yet filled)."""
        if self.owner.writing is not None:
            self.k.index_copy_(2, self.owner.writing, k)
            self.v.index_copy_(2, self.owner.writing, v)
            return self.k, self.v
        start, end = self.owner.length, self.owner.length + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"the KV cache holds {self.k.shape[2]} positions; {end} asked")
        self.k[:, :, start:end], self.v[:, :, start:end] = k, v
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """Keys and values of every layer for `length` positions of `batch` rows, preallocated (Decoder.decode). Zeros,
    not empty memory: a step with its position on the device attends over unfilled positions too, masked, and a
    masked NaN would still poison the sum."""

    def __init__(self, args: ModelArgs, batch: int, length: int, device: torch.device, dtype: torch.dtype):
        shape = (batch, args.n_kv_heads, length, args.head_dim)
        self.capacity = length
        self.length = 0  # positions filled
        self.writing: torch.Tensor | None = None  # the positions a device-positioned step writes (Decoder.decode)
        self.layers = [LayerCache(self, torch.zeros(shape, device=device, dtype=dtype),
                                  torch.zeros(shape, device=device, dtype=dtype)) for _ in range(args.n_layers)]


def graphable(model: torch.nn.Module) -> bool:
    """Whether a decode step of this model may be captured in a CUDA graph: on CUDA, its weights plain tensors of one
    device (not DTensors: FSDP2 gathers them with collectives in each forward)."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    return (bool(params) and params[0].is_cuda and torch.cuda.is_available()
            and not any(isinstance(p, DTensor) for p in params))


class TokenSteps:
    """The decoder's steps of one new token a row over `cache`, after the prompt filled it: `step(tokens [B, 1])`
    returns the logits [B, 1, V] and advances the cache. With `graph` (on CUDA) the first step runs eagerly with its
    position on the device, then is captured; later steps replay the capture. A capture that fails (a forward that
    waits on the host) falls back to eager steps, said once in `fallback`."""

    def __init__(self, model: torch.nn.Module, cache: KVCache, graph: bool):
        self.model, self.cache = model, cache
        self.graph: torch.cuda.CUDAGraph | None = None
        self.use_graph = graph
        self.fallback = ""
        if graph:
            device = cache.layers[0].k.device
            rows = cache.layers[0].k.shape[0]
            self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
            self.position = torch.zeros((), dtype=torch.long, device=device)
            self.logits: torch.Tensor | None = None

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        if not self.use_graph:
            return self.model.decode(tokens, self.cache)
        if self.cache.length >= self.cache.capacity:
            raise ValueError(f"the KV cache holds {self.cache.capacity} positions; {self.cache.length + 1} asked")
        self.tokens.copy_(tokens)
        self.position.fill_(self.cache.length)
        if self.graph is None:
            logits = self._first_step()
        else:
            self.graph.replay()
            logits = self.logits
        self.cache.length += 1
        return logits

    def _first_step(self) -> torch.Tensor:
        """Runs the step eagerly (on a side stream, as capture wants its warm-up), then captures it. The eager run
        writes this position's keys and values, the capture records the same writes without running them."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            logits = self.model.decode(self.tokens, self.cache, position=self.position)
        torch.cuda.current_stream().wait_stream(stream)
        try:
            graph = torch.cuda.CUDAGraph()
            # thread_local: the trainer's other threads (data, checkpoint copies) may use CUDA meanwhile.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.logits = self.model.decode(self.tokens, self.cache, position=self.position)
            self.graph = graph
        except RuntimeError as e:  # the forward synchronizes with the host somewhere: stay eager
            self.use_graph, self.logits = False, None
            self.cache.writing = None
            self.fallback = f"decode steps run eagerly (CUDA graph capture failed: {str(e).splitlines()[0][:160]})"
        return logits.clone()
