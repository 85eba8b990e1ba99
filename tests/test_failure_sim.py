"""bench/failure_sim.py: the goodput model of disk checkpoints, RAM snapshots and peer replicas under failures."""

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

from holotrain.plan.cluster import expected_loss_share, young_daly_interval_s

_spec = importlib.util.spec_from_file_location(
    "failure_sim", Path(__file__).resolve().parents[1] / "bench" / "failure_sim.py")
sim = importlib.util.module_from_spec(_spec)
sys.modules["failure_sim"] = sim  # its dataclasses look their module up
_spec.loader.exec_module(sim)


@pytest.mark.parametrize("mtbf", [1000.0, 6335.0, 20000.0])
def test_replicas_beat_ram_beat_disk_at_scale(mtbf):
    inp = dataclasses.replace(sim.Inputs(), node_mtbf_hours=mtbf)
    for gpus in (2048, 16384):
        disk, ram, replica = (sim.evaluate(s, gpus, inp).goodput for s in sim.STRATEGIES)
        assert replica >= ram >= disk
    # At 16k GPUs each layer pays for itself, not only by falling back on the one below.
    disk, ram, replica = (sim.evaluate(s, 16384, inp, fallback=False) for s in sim.STRATEGIES)
    assert replica.goodput > ram.goodput > disk.goodput
    assert replica.disk_recovery_share < 1e-3 < ram.disk_recovery_share


def test_intervals_are_young_daly_where_no_floor_binds():
    # 512 GPUs: the disk write (27 s) is far under Young/Daly's interval, which must then be its minimum.
    inp = sim.Inputs()
    r = sim.evaluate("disk", 512, inp, fallback=False)
    mtbf_s = r.job_mtbf_s
    state = inp.gpu_state_gb(512)
    save = state * inp.disk_block_s_per_gb + inp.disk_write_slowdown * r.disk_floor_s
    assert r.disk_every_s == pytest.approx(young_daly_interval_s(save, mtbf_s))
    assert r.disk_every_s > r.disk_floor_s
    # ... and the interval at which the saves and the work done again cost the least (the restart adds a constant).
    best = expected_loss_share(save, r.disk_every_s, mtbf_s, 0.0)
    for scale in (0.8, 1.25):
        assert expected_loss_share(save, r.disk_every_s * scale, mtbf_s, 0.0) > best


def test_intervals_respect_each_strategys_floor():
    # Slow storage and a slow replica link: Young/Daly asks for less than the write or the transfer takes.
    inp = dataclasses.replace(sim.Inputs(), node_mtbf_hours=1000.0, storage_write_gb_s=50.0, link_gbit_s=1.0)
    disk = sim.evaluate("disk", 16384, inp, fallback=False)
    assert disk.disk_every_s == pytest.approx(disk.disk_floor_s)  # one write at a time: 16384 x 16.4 GB at 50 GB/s
    assert disk.disk_floor_s == pytest.approx(16384 * 16.4 / 50)
    replica = sim.evaluate("ram+replica", 16384, inp, fallback=False)
    assert replica.snapshot_every_s >= 16.4 * 8 / (1.0 * inp.link_efficiency)  # the replica's transfer
    for s in sim.STRATEGIES:
        for gpus in sim.GPUS:
            r = sim.evaluate(s, gpus, sim.Inputs(), fallback=False)
            assert r.disk_every_s >= r.disk_floor_s
            if r.snapshot_every_s is not None:
                assert r.snapshot_every_s >= r.snapshot_floor_s >= sim.Inputs().step_s


def test_goodput_rises_with_node_mtbf():
    for s in sim.STRATEGIES:
        for gpus in sim.GPUS:
            got = [sim.evaluate(s, gpus, dataclasses.replace(sim.Inputs(), node_mtbf_hours=h)).goodput
                   for h in (500.0, 1000.0, 6335.0, 20000.0, 100000.0)]
            assert got == sorted(got) and got[0] < got[-1]
