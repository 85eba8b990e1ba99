"""`holotrain report RUN_DIR`: the HTML report of a real CPU run and of a synthetic GPU run (telemetry, energy,
memory, throttling), null-tolerance, the missing-run error, and a headless Chromium render check."""

import json
import math
import re
import shutil
import subprocess

import pytest

from holotrain.profile.report import write_report
from tests.conftest import read_metrics, run_cli, run_cli_here, tiny_args

T0 = 1_764_400_000.0  # unix seconds of the synthetic run's start
H200 = {"max_sm_clock_mhz": 1980, "max_mem_clock_mhz": 3201, "power_limit_w": 700.0, "default_power_limit_w": 700.0}
STEP_LINE_COLORS = {"#1f77b4", "#d62728"}  # tokens/s and loss lines


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """A real tiny training run on CPU; its report written by the CLI."""
    run_dir = tmp_path_factory.mktemp("cpu-run")
    run_cli("train", *tiny_args(run_dir, **{"training.steps": 8, "checkpoint.every": 0,
                                            "checkpoint.save_final": False, "profile.report": False}))
    assert not (run_dir / "report.html").exists()
    proc = run_cli("report", str(run_dir))
    assert proc.stdout.strip() == f"wrote {run_dir / 'report.html'}"
    return run_dir


def _telemetry(seconds=25.0, hz=100.0, devices=(0, 1)) -> list[dict]:
    """Two H200s: idle for 2 s, boost at 1980 MHz for 3 s, then pinned at the 700 W cap (SwPowerCap, 0x4) with
    the SM clock sagging to ~1530 MHz and dipping to 1410; a logged step every second from t = 3 s."""
    recs = []
    for d in devices:
        recs.append({"kind": "device", "t": T0, "device": d, "cuda_index": d, "rank": d, "name": "NVIDIA H200",
                     "uuid": f"GPU-0000000{d}", **H200})
    energy = {d: 1.0e6 for d in devices}
    n = int(seconds * hz)
    for i in range(n):
        t = i / hz
        for d in devices:
            if t < 2.0:
                clk, pw, thr, util = 345, 78.0 + d, 0x1, 0
            elif t < 5.0:
                clk, pw, thr, util = 1980, 610.0 + 20 * (t - 2), 0x0, 98
            else:
                clk = 1530 + int(60 * math.sin(t * 3.1 + d)) - (120 if int(t * 10) % 37 == 0 else 0)
                pw, thr, util = 699.0 + (i % 3) * 0.5, 0x4, 99
            energy[d] += pw / hz
            recs.append({"kind": "sample", "t": T0 + t, "device": d, "sm_clock_mhz": clk, "mem_clock_mhz": 3201,
                         "power_w": pw, "energy_j": energy[d], "temp_c": 35 + int(30 * t / seconds),
                         "util_gpu": util, "util_mem": util // 2, "throttle": thr})
        if t >= 3.0 and abs(t - round(t)) < 1e-9:
            recs.append({"kind": "step", "t": T0 + t, "step": int(t) - 2})
    return recs


def _gpu_rows(steps=22) -> list[dict]:
    rows = []
    for s in range(1, steps + 1):
        capped = s > 2
        step_s = 1.0 if capped else 0.85
        phases = {"time.data_wait": 0.012, "time.forward": 0.30 * step_s, "time.backward": 0.55 * step_s,
                  "time.optimizer": 0.05, "time.offload_transfer": 0.03, "time.exposed_comm": 0.04}
        rows.append({
            "step": s, "loss": 10.4 * math.exp(-s / 30), "lr": 3e-4, "grad_norm": 1.2, "tokens_per_s": 16384 / step_s,
            "tflops": 380.0 / step_s, "mfu": 0.384 / step_s, "step_s": step_s, **phases,
            "mem.peak_gb": 61.0 + 0.01 * s, "mem.reserved_gb": 70.5, "mem.host_rss_gb": 12.0 + 0.1 * s,
            "tokens": s * 16384, "wall_time": T0 + 2 + s, "energy.joules": 1400.0 * step_s,
            "energy.j_per_token": 1400.0 * step_s / 16384, "hw.sm_clock_mhz": 1530 if capped else 1980,
            "hw.mem_clock_mhz": 3201, "hw.power_w": 699.5, "hw.temp_c": 60,
            "hw.power_capped_frac": 1.0 if capped else 0.0,
        })
    return rows


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory):
    """A synthetic 2-GPU run directory: config, metrics, telemetry, probe and a trace."""
    run_dir = tmp_path_factory.mktemp("gpu-run")
    (run_dir / "config.toml").write_text(
        '[job]\nname = "h200-synthetic"\ndevice = "cuda"\n\n[model]\npreset = "1.4b"\ndim = 2048\nn_layers = 24\n'
        'n_heads = 16\nn_kv_heads = 16\nffn_dim = 5632\nvocab_size = 32000\n\n[data]\nseq_len = 2048\n\n'
        '[training]\nsteps = 22\nbatch_size = 8\n'
    )
    _write_jsonl(run_dir / "metrics.jsonl", _gpu_rows())
    _write_jsonl(run_dir / "telemetry.jsonl", _telemetry())
    (run_dir / "hw_probe.json").write_text(json.dumps({
        "device": {"name": "NVIDIA H200", "max_sm_clock_mhz": 1980}, "gemm_tflops": 788.0,
        "pcie_pinned_gbs": {"h2d": 55.1, "d2h": 54.8}, "summary": "H200: bf16 GEMM 788 TF/s <script>x</script>",
    }))
    (run_dir / "traces").mkdir()
    (run_dir / "traces" / "rank0-step10.pt.trace.json.gz").write_bytes(b"\x1f\x8b" + b"\0" * 100)
    write_report(run_dir)
    return run_dir


def _chart_ids(page: str) -> list[str]:
    return re.findall(r'<svg class="chart" id="([^"]+)"', page)


def _self_contained(page: str) -> None:
    assert not re.search(r"<(script|img|link|iframe)[^>]+(src|href)=", page, re.IGNORECASE)
    assert "@import" not in page and "url(" not in page
    assert "<script>x</script>" not in page  # text is escaped


def test_cpu_run_report(cpu_run):
    page = (cpu_run / "report.html").read_text()
    _self_contained(page)
    rows = read_metrics(cpu_run)
    assert len(rows) == 8
    # header: run, model size, steps, final loss
    assert "holotrain report: default" in page
    assert "0.2M parameters" in page and "dim 64" in page
    assert "8 of 8 (8 logged)" in page
    assert f"{rows[-1]['loss']:.3f}"[:4] in page
    assert "CPU" in page
    # charts present: throughput, loss, goodput, phases; GPU-only ones replaced by one-line notes
    ids = _chart_ids(page)
    assert ids[:4] == ["chart-tokens", "chart-loss", "chart-goodput", "chart-phases"]
    assert "goodput (useful tokens / wall second)" in page
    # host RSS is the only memory figure a CPU run may have
    assert ("chart-memory" in ids) == any(r.get("mem.host_rss_gb") is not None for r in rows)
    assert len(ids) == 4 + ("chart-memory" in ids)
    for phase in ("data_wait", "forward", "backward", "optimizer"):
        assert f">{phase}</text>" in page  # legend of the stacked bars
    assert "No telemetry.jsonl and no hw.* metrics" in page
    assert "No energy figures" in page
    # where the time goes: ranked largest first, each with a lever
    table = page.split('<table class="sinks">')[1].split("</table>")[0]
    secs = [float(x) for x in re.findall(r'<td class="num">([0-9.e+-]+)</td><td class="nowrap"><span', table)]
    assert len(secs) >= 4 and secs == sorted(secs, reverse=True)
    assert "data.workers" in table and "training.compile" in table
    assert "clock drop" not in table  # no telemetry: no DVFS item


def test_gpu_like_report(gpu_run):
    page = (gpu_run / "report.html").read_text()
    _self_contained(page)
    assert len(page) < 400_000
    ids = _chart_ids(page)
    assert ids == ["chart-tokens", "chart-loss", "chart-phases", "chart-sm-clock", "chart-power", "chart-energy",
                   "chart-j-per-token", "chart-throttle", "chart-memory"]
    assert "NVIDIA H200 (2 devices)" in page
    assert "1,364.3M parameters" in page
    assert "MFU</th><td>38.7%" in page  # steady-state mean (first logged step excluded)
    # extra phases from later levers appear in the stacked bars and the ranking, with their levers
    for phase in ("offload_transfer", "exposed_comm"):
        assert f">{phase}</text>" in page
    assert "memory.offload_ratio" in page and "parallel.tp_overlap" in page
    # telemetry: 2 x 2500 samples reduced to at most 2000 points per device line
    clock_svg = page.split('id="chart-sm-clock"')[1].split("</svg>")[0]
    paths = re.findall(r'<path class="mark" d="([^"]+)"', clock_svg)
    assert len(paths) == 2
    for d in paths:
        assert 500 < d.count("L") < 2000
    assert "max 1980 MHz" in clock_svg and "step 1" in clock_svg
    assert "limit 700 W" in page
    # throttle reasons: SwPowerCap dominates the busy time
    assert "DVFS analysis failed" not in page and "DVFS analysis unavailable" not in page
    throttle_svg = page.split('id="chart-throttle"')[1].split("</svg>")[0]
    assert re.findall(r">([A-Za-z]+)</text>", throttle_svg)[0] == "SwPowerCap"
    assert "87.0%" in throttle_svg  # capped from t = 5 s of the 23 busy seconds
    assert "GpuIdle" not in throttle_svg  # reasons never active while busy are only named in a note
    # where the time goes: backward first; the clock drop priced by the DVFS analysis
    table = page.split('<table class="sinks">')[1].split("</table>")[0]
    names = re.findall(r'<td class="num">\d+</td><td>([^<]+)</td>', table)
    assert names[0] == "backward" and "forward" in names[1:3]
    assert any(n.startswith("clock drop") for n in names)
    assert "hw.power_limit_w" in table
    # probe table and trace links
    assert "gemm_tflops" in page and "pcie_pinned_gbs.h2d" in page
    assert '<a href="traces/rank0-step10.pt.trace.json.gz">' in page and "ui.perfetto.dev" in page


def test_nulls_nan_and_garbage_are_tolerated(tmp_path):
    rows = [
        {"step": 1, "loss": None, "tokens_per_s": None, "step_s": None, "mfu": None, "time.forward": None},
        {"step": 2, "loss": float("nan"), "tokens_per_s": 100.0, "step_s": 0.5, "time.forward": 0.2,
         "time.backward": "fast", "mem.peak_gb": None, "energy.joules": None, "hw.sm_clock_mhz": None},
        {"loss": 3.0, "tokens_per_s": float("inf"), "step_s": 0.4, "time.forward": 0.5},  # no step; phases > step
        {"step": 4, "loss": 2.5, "tokens_per_s": 120.0, "step_s": 0.45, "data.workers": {"code": 2}},
    ]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "loss": 2.\n\n[1, 2]\n'  # truncated line
    (tmp_path / "metrics.jsonl").write_text(text)
    (tmp_path / "config.toml").write_text("[job\nname = broken")
    _write_jsonl(tmp_path / "telemetry.jsonl", [
        {"kind": "device", "t": T0, "device": 0, "name": None, "max_sm_clock_mhz": None, "power_limit_w": None},
        {"kind": "sample", "t": T0, "device": 0, "sm_clock_mhz": None, "power_w": None, "energy_j": None,
         "throttle": None},
        {"kind": "sample", "t": None, "device": 0},
        {"kind": "step", "t": T0 + 1, "step": None},
        {"kind": "mystery"},
    ])
    (tmp_path / "hw_probe.json").write_text("{not json")
    out = write_report(tmp_path)
    page = out.read_text()
    assert _chart_ids(page) == ["chart-tokens", "chart-loss", "chart-phases"]  # no empty clock/power frames
    assert "no SM clock or power readings" in page
    assert "No memory figures" in page and "No energy figures" in page
    assert "—" in page  # unknown values shown as a dash
    # an empty metrics file is still a report, with notes instead of charts
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "telemetry.jsonl").unlink()
    page = write_report(tmp_path).read_text()
    assert _chart_ids(page) == [] and "No tokens_per_s" in page and "No time.* phase times" in page
    assert not list(tmp_path.glob(".report.html.tmp*"))


def test_missing_metrics_is_one_line_error(tmp_path):
    proc = run_cli_here("report", tmp_path / "nowhere")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(tmp_path / "nowhere") in lines[0] and "metrics.jsonl" in lines[0]
    assert not (tmp_path / "nowhere").exists()


# --------------------------------------------------------------------------------------------
# Rendering in a real browser


def _chromium() -> str:
    path = shutil.which("chromium") or ("/usr/bin/chromium" if shutil.os.path.exists("/usr/bin/chromium") else None)
    if not path:
        pytest.skip("chromium not installed")
    return path


def _run_chromium(tmp_path, *args) -> subprocess.CompletedProcess:
    profile = tmp_path / "chromium-profile"
    profile.mkdir(exist_ok=True)
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
           "--force-device-scale-factor=1", "--virtual-time-budget=2000", f"--user-data-dir={profile}", *args]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60)


def _hex(color: str) -> tuple[int, int, int]:
    return tuple(int(color[i:i + 2], 16) for i in (1, 3, 5))


@pytest.mark.parametrize("which", ["cpu_run", "gpu_run"])
def test_report_renders_in_chromium(which, request, tmp_path):
    pytest.importorskip("PIL")
    from PIL import Image

    _chromium()
    run_dir = request.getfixturevalue(which)
    url = (run_dir / "report.html").resolve().as_uri()
    expected = _chart_ids((run_dir / "report.html").read_text())

    # (b) the inline script recorded each chart's rendered box and its drawn data marks
    proc = _run_chromium(tmp_path, "--dump-dom", "--window-size=1280,4000", url)
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = re.search(r'<pre id="render-check">([^<]*)</pre>', proc.stdout)
    assert m, proc.stdout[:2000]
    rendered = json.loads(m.group(1).replace("&quot;", '"'))
    assert [r["id"] for r in rendered] == expected
    for r in rendered:
        assert r["w"] > 200 and r["h"] > 100 and r["marks"] >= 1, r

    # (a) the screenshot shows the charts: colored pixels inside each chart's box, the line colors among them
    png = tmp_path / "report.png"
    proc = _run_chromium(tmp_path, f"--screenshot={png}", "--window-size=1280,4000", url)
    assert png.is_file(), proc.stderr[-2000:]
    img = Image.open(png).convert("RGB")
    assert img.size == (1280, 4000)
    pixels = img.load()
    checked = 0
    for r in rendered:
        if r["y"] + r["h"] > img.size[1]:
            continue
        colored = sum(
            1
            for x in range(r["x"], r["x"] + r["w"], 2)
            for y in range(r["y"], r["y"] + r["h"], 2)
            if max(pixels[x, y]) - min(pixels[x, y]) > 60
        )
        assert colored > 40, (r, colored)
        checked += 1
    assert checked >= min(len(rendered), 3)
    counts = {c: 0 for c in STEP_LINE_COLORS}
    targets = {c: _hex(c) for c in STEP_LINE_COLORS}
    for n, px in img.getcolors(maxcolors=1 << 24):
        for c, t in targets.items():
            if abs(px[0] - t[0]) + abs(px[1] - t[1]) + abs(px[2] - t[2]) < 30:
                counts[c] += n
    for c, n in counts.items():
        assert 200 < n < 400_000, (c, n)  # the line colors are drawn, and not as a flood fill
