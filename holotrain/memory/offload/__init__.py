"""ZeRO-Offload: fp32 master weights and AdamW states in host memory, working weights on the GPU, and the CPU
step overlapped with backward and with the next forward. Switched on by `memory.offload = true`; built by
holotrain.memory.build_optimizer, and driven like every StepOptimizer (holotrain/optim): begin(lr, accum) before
the micro-batches, finish() after them.

A step, on one GPU:

  backward     A post-accumulate-grad hook counts each offloaded parameter's gradient. When a bucket (one unit
               of holotrain/memory/plan.py: the embedding, one block, or the final norm + output head) has all
               of its gradients, the GPU takes their squared norm (one landing per step; microseconds), then they
               are copied on a side stream ("D2H") into the bucket's pinned staging buffer, the norm after them,
               and freed on the GPU, so at most a few buckets' gradients exist on the GPU at a time.
  CPU worker   One thread. It *lands* each bucket (its copy is done: with one landing per step that is all,
               since the norm came with it; with accumulation it adds the micro-batch into an fp32 accumulator,
               and at the last one takes the sum's squared norm in the same pass), then *updates* it: AdamW on
               flat fp32 buffers in one pass that reads the gradient in its own dtype (bf16) and writes the new
               weights in the working dtype into an upload buffer as it goes. The loops are a torch C++ extension
               (csrc/adamw.cpp, torch's fused AdamW math) built once per host on first use (`cpu_kernels`), called
               once per bucket: the call releases the GIL and runs the bucket on `memory.offload_threads` native
               threads, so Python on the training thread never holds it up. Where the extension cannot be built
               (or with memory.offload_kernel = "torch"), torch ops in chunks (three passes). The upload buffer is
               copied into the working weights on a second side stream ("H2D").
  order        Landings whose copy is done come first; then, among landed buckets, the update the next forward
               needs first; a landing still waiting for its copy only when there is nothing else (the host runs
               ahead of the GPU in backward and queues every copy early: waiting for each in turn would keep the
               updates until backward ends). During backward the update taken is that of the bucket that landed
               last; once backward ends it is the embedding, then block 0, block 1, ..., so the next forward
               starts as soon as its first bucket is back and the buckets left over are those it needs last.
  next forward A forward pre-hook per unit waits until that unit's final weights are uploaded (host wait, then
               the compute stream waits on the upload's CUDA event). The wait is timed as `time.offload_wait`:
               the exposed, non-overlapped part of offloading.

Gradient clipping needs the global norm, known only when backward ends, while the point of the worker is to
update buckets before that. The engine speculates: when the previous step was not clipped (norms usually stay
below the threshold once training settles), each bucket is updated as soon as it lands, unclipped, and
uploaded. When backward ends the norm is summed from the buckets' norms (and the GPU-side gradients, and over
the ranks). If it needs no clipping the speculative updates are final. If it does (or is not finite), every
speculatively updated bucket is rolled back, since AdamW's step is invertible given the gradient (kept until
the next step), and redone with the clipped gradient (or left as it was: the step is skipped). After a
clipped step the next one does not speculate: it lands everything, waits for the norm and updates once, in
forward order, overlapping only the next forward. So a misprediction costs one extra pass over the buckets,
and only at the step where the norm first crosses the threshold. The alternative, computing the norm before
any update, would leave the CPU idle for all of backward on every step. A rollback restores the weights to
within fp32 rounding; for bit-exact reproducibility every bucket of a mispredicted step takes the same path
(update, roll back, redo) whether or not it had been updated when the norm arrived.

Delayed parameter update (`memory.offload_delayed_update`; one landing per step: one micro-batch on one process,
any number with FSDP2, which reduce-scatters once): step t's forward
and backward run on the weights from update t-2, so update t-1 overlaps the whole of step t instead of its
forward. No speculation: the norm is known before each update. The worker updates in backward's order (last bucket
first) and writes the new weights in the working dtype over the gradient in the staging buffer; when step t's
backward is done with a bucket (its gradient hook), the engine first uploads those weights (H2D), then copies the
new gradient into the same buffer (D2H, after the upload has read it), waiting on the host if the CPU has not
finished that bucket (`offload.release_wait_s`). The forward gates only order the compute stream after the upload.
Checkpoints save the working weights beside the masters, and a resume puts the masters back in the staging buffer
as the next upload; no HeldState (the working weights would change under the writer).

Partial offload (`memory.offload_ratio`): the last units in forward order run on the CPU, the rest (and all
norm weights) are ordinary fp32 parameters with holotrain.optim's fused AdamW on the device, clipped with the
same norm.

Several ranks (FSDP2): each rank holds 1/N of every parameter, so the engine on the local shards is the ZeRO
partition: 1/N of the masters and moments per rank. FSDP2 reduce-scatters gradients and calls the
post-accumulate-grad hooks of the sharded parameters itself; working shards stay fp32 (FSDP2 gathers them in
bf16). FSDP2 starts its all-gathers on its own streams, synchronized with the compute stream once, at the
root's forward, so with several ranks the engine waits for all buckets there instead of per unit.

On the CPU device (tests) the same code runs without streams: copies are synchronous, working weights fp32.

The modules:

  engine.py    OffloadEngine: setup, buckets, the backward hooks and forward gates, streams, the step's decision
  worker.py    the CPU worker (a mixin of the engine): task order, landing, update, rollback, upload
  buckets.py   a bucket's host buffers, the per-step records and bucket states
  kernels.py   the CPU loops (adamw_flat, accumulate_flat): the extension's build and check, the torch-op path
  csrc/        the extension's C++ source
  host.py      host memory: huge pages, exact-size page-locked buffers
  state.py     checkpoint state (OffloadEngine.state_dict / load_state_dict)

Importing this package builds nothing: the extension is built at the first cpu_kernels() call (an engine's
construction), a few tens of seconds once per host and torch version, then loaded from torch's extensions cache.
"""

from holotrain.memory.offload.engine import OffloadEngine
from holotrain.memory.offload.kernels import CHUNK, CpuKernels, accumulate_flat, adamw_flat, cpu_kernels

__all__ = ["CHUNK", "CpuKernels", "OffloadEngine", "accumulate_flat", "adamw_flat", "cpu_kernels"]
