"""What the ranks' agreement on an interrupt costs a step: StopSignals.requested() (one 4-byte all-reduce on a gloo
group of its own, host memory only, waited for at the next call), timed over many calls on N local processes;
median and 90th percentile. --step-ms puts a step's worth of other work between the calls (each rank's a little
different, as real steps are); 0 calls it back to back, where each call waits for the previous one's all-reduce.

    python bench/stop_agreement.py --ranks 2 --calls 300 --step-ms 20
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import time

import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, port: int, calls: int, step_s: float, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from holotrain.train.interrupts import StopSignals

    stop = StopSignals()
    stop.start_loop(world)
    times = []
    jitter = random.Random(rank)
    for _ in range(calls):
        time.sleep(step_s * (1 + 0.2 * jitter.random()))
        t0 = time.perf_counter()
        stop.requested()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        times = times[calls // 10:]  # warm-up
        times.sort()
        out.put((statistics.median(times), times[int(0.9 * len(times))]))
    dist.destroy_process_group(stop.group)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--step-ms", type=float, default=20.0)
    a = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, a.ranks, port, a.calls, a.step_ms / 1e3, out)) for r in range(a.ranks)]
    for p in procs:
        p.start()
    median, p90 = out.get()
    for p in procs:
        p.join()
    print(f"StopSignals.requested() on {a.ranks} gloo ranks: median {median * 1e6:.0f} us, p90 {p90 * 1e6:.0f} us "
          f"({a.calls} calls, {a.step_ms:g} ms of work between them)")


if __name__ == "__main__":
    main()
