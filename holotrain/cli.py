"""`holotrain train|export` — the command line."""

from __future__ import annotations

import argparse
import sys
import threading

from holotrain.config import ConfigError, load_config
from holotrain.errors import TrainingStopped

USAGE = """usage:
  holotrain train [--config FILE.toml | NAME] [--section.key=value ...]
  holotrain export RUN_DIR OUT_DIR [--checkpoint DIR]
  holotrain report RUN_DIR
  holotrain hw probe [--out FILE.json] [--seconds N]
"""


def _train(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="holotrain train", add_help=True)
    parser.add_argument("--config", help="TOML config file, or a shipped config's name: tiny, 125m, 1.4b, "
                        "1.4b-tp2, offload (default: the embedded tiny model)")
    known, overrides = parser.parse_known_args(argv)
    cfg = load_config(known.config, overrides)
    from holotrain.train import train

    train(cfg)
    # Every thread of ours is joined by the time training returns: one still running at interpreter shutdown can
    # take the process down inside a native call (std::terminate) after the run succeeded.
    alive = [t.name for t in threading.enumerate() if t.name.startswith("holotrain") and t.is_alive()]
    if alive:
        print(f"holotrain: warning: threads still running after training: {', '.join(alive)}", file=sys.stderr)
    return 0


def _export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="holotrain export")
    parser.add_argument("run_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--checkpoint", help="checkpoint directory (default: the run's newest)")
    a = parser.parse_args(argv)
    from holotrain.export import export_hf

    out = export_hf(a.run_dir, a.out_dir, a.checkpoint)
    print(f"exported {a.run_dir} -> {out} (Hugging Face LlamaForCausalLM)")
    return 0


def _report(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="holotrain report")
    parser.add_argument("run_dir")
    a = parser.parse_args(argv)
    from holotrain.profile.report import write_report

    print(f"wrote {write_report(a.run_dir)}")
    return 0


def _hw(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="holotrain hw")
    sub = parser.add_subparsers(dest="what", required=True)
    probe = sub.add_parser("probe", help="characterize this machine's GPU (and host) in under a minute")
    probe.add_argument("--out", default="hw_probe.json", help="JSON file to write (default: ./hw_probe.json)")
    probe.add_argument("--seconds", type=float, default=45.0, help="time budget of the whole probe")
    a = parser.parse_args(argv)
    from holotrain.hw.probe import run_probe

    result = run_probe(a.out, a.seconds)
    print(f"wrote {a.out}: {result['summary']}")
    return 0


COMMANDS = {"train": _train, "export": _export, "report": _report, "hw": _hw}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(USAGE, file=sys.stderr, end="")
        return 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except ConfigError as e:
        print(f"holotrain: error: {e}", file=sys.stderr)
        return 2
    except TrainingStopped as e:
        print(f"holotrain: stopped: {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
