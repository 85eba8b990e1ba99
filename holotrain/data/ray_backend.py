"""Source loaders as Ray actors (`data.backend = "ray"`), for data planes that span machines.

Same contract as plane.LoaderPool: chunks are dispatched in consumption order, delivered whole, and a
dead actor's undelivered chunks are read again by its replacement. Tokens (and a chat source's mask of the
tokens trained on) travel through Ray's object store (shared memory on the same node) as numpy arrays.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray

from holotrain.data.chat import reader_for
from holotrain.data.split import Split
from holotrain.data.worker import tokenize_chunk
from holotrain.errors import ConfigError


@ray.remote(num_cpus=1)
class LoaderActor:
    def __init__(self, files: list[str], src, tokenizer_path: str, eos_id: int, chat_template: str,
                 split: Split | None = None):
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per actor, as for local workers
        from tokenizers import Tokenizer

        self.paths = [Path(f) for f in files]
        self.text_field, self.eos_id = src.text_field, eos_id
        self.tokenizer = Tokenizer.from_file(tokenizer_path)
        self.chat = reader_for(src, chat_template, tokenizer_path)
        self.split = split

    def load(self, chunk, epoch: int) -> dict:
        tokenized = tokenize_chunk(chunk, self.paths, self.text_field, self.tokenizer, self.eos_id, self.chat,
                                   self.split)
        return {"source": chunk.source, "index": chunk.index, "epoch": epoch, "arrays": tokenized.arrays(),
                "n_tokens": len(tokenized.tokens), "n_docs": len(tokenized.keys), "records": tokenized.text.records,
                "skipped": tokenized.text.skipped,
                "skip_examples": tokenized.text.skip_examples}


@dataclass
class _Actor:
    handle: object
    source: int
    inflight: dict = field(default_factory=dict)  # (epoch, index) -> (chunk, ObjectRef)


class RayLoaderPool:
    def __init__(self, spec, files: list[list[Path]]):
        if not ray.is_initialized():
            ray.init(address=spec.ray_address or None, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
        self.spec, self.files = spec, files
        # A core per actor where the cluster has them; on a small one, a share, so every source gets an
        # actor (an actor waiting for a CPU would stall its source).
        self.cpus = min(1.0, ray.cluster_resources().get("CPU", 1) / len(spec.sources))
        self.actors: list[_Actor] = []
        self.ready: dict[tuple, dict] = {}
        self.restarts = 0
        self._delivered = [0] * len(spec.sources)
        self._last_scale = [0.0] * len(spec.sources)
        for s in range(len(spec.sources)):
            self._spawn(s)

    def _spawn(self, source: int) -> _Actor:
        src = self.spec.sources[source]
        handle = LoaderActor.options(num_cpus=self.cpus).remote([str(f) for f in self.files[source]], src,
                                                                self.spec.tokenizer_path, self.spec.eos_id,
                                                                self.spec.chat_template,
                                                                Split(src.name, self.spec.holdout))
        actor = _Actor(handle, source)
        self.actors.append(actor)
        return actor

    def live(self, source: int) -> list[_Actor]:
        return [a for a in self.actors if a.source == source]

    def counts(self) -> dict[str, int]:
        return {s.name: len(self.live(i)) for i, s in enumerate(self.spec.sources)}

    def _submit(self, actor: _Actor, epoch: int, chunk) -> None:
        actor.inflight[(epoch, chunk.index)] = (chunk, actor.handle.load.remote(chunk, epoch))

    def prefetch(self, source: int, upcoming: list) -> None:
        actors = self.live(source)
        inflight = {k for a in actors for k in a.inflight}
        for epoch, chunk in upcoming:
            if (epoch, chunk.index) in inflight or (source, epoch, chunk.index) in self.ready:
                continue
            a = min(actors, key=lambda a: len(a.inflight))
            if len(a.inflight) >= 2:
                break
            self._submit(a, epoch, chunk)
        backlog = sum(1 for k in self.ready if k[0] == source)
        if backlog > 4 * len(actors) and len(actors) > 1 and not actors[-1].inflight:
            ray.kill(actors[-1].handle)
            self.actors.remove(actors[-1])

    def wait(self, source: int, epoch: int, index: int) -> dict:
        key = (source, epoch, index)
        t0 = time.monotonic()
        while key not in self.ready:
            self._harvest(source)
            if key not in self.ready and time.monotonic() - t0 > 0.05:
                self._scale_up(source)
        return self.ready.pop(key)

    def _harvest(self, source: int) -> None:
        refs = {ref: a for a in self.live(source) for _, ref in a.inflight.values()}
        if not refs:
            return
        done, _ = ray.wait(list(refs), num_returns=1, timeout=0.05)
        for ref in done:
            actor = refs[ref]
            try:
                res = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError):
                self._replace(actor)
                return
            except ray.exceptions.RayTaskError as e:  # the chunk itself is bad: same error on any actor
                if isinstance(e.cause, ConfigError):
                    raise ConfigError(str(e.cause)) from None
                raise
            actor.inflight.pop((res["epoch"], res["index"]), None)
            self.ready[(res["source"], res["epoch"], res["index"])] = res
            self._delivered[source] += 1

    def _replace(self, dead: _Actor) -> None:
        """The actor died: a new one reads again every chunk it had not delivered."""
        self.actors.remove(dead)
        self.restarts += 1
        new = self._spawn(dead.source)
        for (epoch, _), (chunk, _) in dead.inflight.items():
            self._submit(new, epoch, chunk)

    def _scale_up(self, source: int) -> None:
        now = time.monotonic()
        free_cpu = ray.available_resources().get("CPU", 0)
        if (self._delivered[source] and free_cpu >= self.cpus and len(self.actors) < self.spec.max_workers
                and now - self._last_scale[source] > 0.5):
            self._last_scale[source] = now
            self._spawn(source)

    def close(self) -> None:
        for a in self.actors:
            ray.kill(a.handle)
        self.actors, self.ready = [], {}
        ray.shutdown()
