"""`holotrain train|export` — the command line."""

from __future__ import annotations

import argparse
import os
import sys
import threading

# Only light imports here: torch comes with the command's own imports, inside main(), so that a Ctrl-C while it
# loads is one line too.
from holotrain.errors import ConfigError, Interrupted, SaveFailed, TrainingStopped

USAGE = """usage:
  holotrain train [--config FILE.toml | NAME] [--plan auto | PLAN.toml] [--section.key=value ...]
  holotrain plan [--config FILE.toml | NAME] [--out DIR] [--nproc N | --cluster FILE | NAME] [--section.key=value ...]
  holotrain export RUN_DIR OUT_DIR [--checkpoint DIR]
  holotrain generate RUN_DIR | HF_DIR --prompt TEXT [--chat] [--max-new-tokens N] [--temperature T] [--top-p P] [--top-k K]
  holotrain report RUN_DIR
  holotrain hw probe [--out FILE.json] [--seconds N]
"""


TRAIN_USAGE = """holotrain train [-h [SECTION]] [--config FILE.toml | NAME] [--plan auto | PLAN.toml]
                       [--section.key=value ...]"""
PLAN_USAGE = """holotrain plan [-h [SECTION]] [--config FILE.toml | NAME] [--out DIR]
                      [--nproc N | --cluster FILE | NAME] [--section.key=value ...]"""


def _parser(prog: str, **kwargs) -> argparse.ArgumentParser:
    """A command's parser whose --help goes on to list every config key (holotrain/config_help.py)."""
    parser = argparse.ArgumentParser(prog=prog, add_help=False, **kwargs)
    parser.add_argument("-h", "--help", nargs="?", const="", metavar="SECTION", help="show this help and every "
                        "config key with its default and meaning; with SECTION (data, training, ...) that section's keys")
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, list[str]] | None:
    """The command's options and the rest, the --section.key=value overrides; None once --help is printed. A
    misspelt option (--confg) is one error naming the closest one."""
    from holotrain.config_values import closest

    known, rest = parser.parse_known_args(argv)
    if known.help is not None:
        from holotrain.config_help import config_reference

        print(config_reference(known.help) if known.help else f"{parser.format_help()}\n{config_reference()}", end="")
        return None
    options = [name for action in parser._actions for name in action.option_strings]
    for arg in rest:
        name = arg.partition("=")[0]
        # A strict cutoff: --steps is not --help misspelt (load_config suggests --training.steps for it).
        near = closest(name, options, cutoff=0.75) if name.startswith("-") and "." not in name else None
        if near:
            raise ConfigError(f"unrecognized argument {name!r} (did you mean {near}?)")
    return known, rest


def _train(argv: list[str]) -> int:
    parser = _parser("holotrain train", usage=TRAIN_USAGE)
    parser.add_argument("--config", help="TOML config file, or a shipped config's name: tiny, 125m, 1.4b, "
                        "1.4b-tp2, offload (default: the embedded tiny model)")
    parser.add_argument("--plan", help="auto: plan the job (holotrain plan) and train with the plan; or a "
                        "plan.toml that holotrain plan wrote for this job on this machine")
    parsed = _parse(parser, argv)
    if parsed is None:
        return 0
    known, overrides = parsed
    if known.plan:
        overrides = _planned(known.config, overrides, known.plan)
    from holotrain.config import load_config

    cfg = load_config(known.config, overrides)
    from holotrain.train import train

    train(cfg)
    # Every thread of ours is joined by the time training returns: one still running at interpreter shutdown can
    # take the process down inside a native call (std::terminate) after the run succeeded.
    alive = [t.name for t in threading.enumerate() if t.name.startswith("holotrain") and t.is_alive()]
    if alive:
        print(f"holotrain: warning: threads still running after training: {', '.join(alive)}", file=sys.stderr)
    return 0


def _planned(config: str | None, overrides: list[str], plan: str) -> list[str]:
    """The overrides with a plan's settings put before the command line's own (which still win)."""
    import shutil
    from pathlib import Path

    from holotrain.plan.planner import make_plan, plan_overrides, print_table
    from holotrain.plan.machine import machine_fingerprint
    from holotrain.plan.planner import job_config, plan_device

    cfg = job_config(config, overrides)
    device = plan_device(cfg)
    here = machine_fingerprint(device, cfg.hw.gpu_memory_gb)
    if plan == "auto":
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError("--plan auto plans in one process; for several, plan first (holotrain plan --nproc N) "
                              "and give every rank the plan: torchrun ... train --plan PLAN.toml")
        result = make_plan(config, overrides, cfg.run_dir)
        print_table(result)
        plan = str(cfg.run_dir / "plan.toml")
    else:
        from holotrain.plan.cluster_cli import refuse_off_cluster

        refuse_off_cluster(Path(plan), int(os.environ.get("WORLD_SIZE", "1")), here)
    planned = plan_overrides(Path(plan), config, overrides, here)
    candidates = Path(plan).with_name("plan.json")  # the report compares the run with the plan's predictions
    if candidates.is_file() and candidates.parent.resolve() != cfg.run_dir.resolve():
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(candidates, cfg.run_dir / "plan.json")
    return planned + overrides


def _plan(argv: list[str]) -> int:
    parser = _parser("holotrain plan", usage=PLAN_USAGE, epilog="--section.key=value overrides the job's config; a "
                     "setting the plan chooses (micro-batch, checkpointing, offload and its ratio, loss chunking, "
                     "compile, fp8, tp) given this way is kept, and the rest chosen")
    parser.add_argument("--config", help="TOML config file, or a shipped config's name (default: the embedded tiny "
                        "model)")
    parser.add_argument("--out", help="where plan.toml and plan.json go (default: the job's run directory)")
    parser.add_argument("--nproc", type=int, help="processes (GPUs) of this node the job will run on "
                        "with torchrun --nproc_per_node (default 1): tensor and data parallelism are planned too")
    parser.add_argument("--cluster", help="plan the job, on paper, for a cluster it is not running on: a cluster "
                        "file (TOML: nodes, GPUs per node, links, MTBF) or the name of a shipped one, such as "
                        "h200-64")
    parsed = _parse(parser, argv)
    if parsed is None:
        return 0
    known, overrides = parsed
    if known.nproc is not None and known.nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {known.nproc}")
    if known.nproc is not None and known.cluster:
        raise ConfigError("--nproc plans this node's GPUs and --cluster a cluster file's: give one of them")
    from pathlib import Path

    from holotrain.plan.planner import make_plan, print_table
    from holotrain.plan.planner import job_config

    out = Path(known.out) if known.out else job_config(known.config, overrides).run_dir
    if known.cluster:
        from holotrain.plan.cluster_cli import make_cluster_plan, print_cluster_table

        print_cluster_table(make_cluster_plan(known.config, overrides, known.cluster, out))
    else:
        print_table(make_plan(known.config, overrides, out, ranks=known.nproc or 1))
    print(f"wrote {out / 'plan.toml'} and {out / 'plan.json'}")
    return 0


def _export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="holotrain export")
    parser.add_argument("run_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--checkpoint", help="checkpoint directory (default: the run's newest)")
    a = parser.parse_args(argv)
    from holotrain.export import export_hf

    out = export_hf(a.run_dir, a.out_dir, a.checkpoint)
    import json

    architecture = json.loads((out / "config.json").read_text())["architectures"][0]
    print(f"exported {a.run_dir} -> {out} (Hugging Face {architecture})")
    return 0


def _generate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="holotrain generate",
                                     description="Continue a prompt with a trained run or a Hugging Face model.")
    parser.add_argument("source", help="a run directory (its newest checkpoint), a checkpoint in one, or a Hugging "
                                       "Face model directory")
    parser.add_argument("--prompt", required=True, help="the text to continue (with --chat: the user's message)")
    parser.add_argument("--chat", action="store_true", help="render the prompt as a user turn with the chat template")
    parser.add_argument("--system", default="", help="with --chat: a system message before it")
    parser.add_argument("--messages", help="a JSON file with a conversation ([{role, content}, ...]) to answer")
    parser.add_argument("--checkpoint", help="a checkpoint directory of the run (default: its newest)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sample within this probability mass (1: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="auto (a GPU if there is one) | cpu | cuda")
    a = parser.parse_args(argv)
    import json

    from holotrain.generate import Sampling, load

    sampling = Sampling(a.max_new_tokens, a.temperature, a.top_k, a.top_p, a.seed)
    sampling.check()  # before the model loads
    messages = None
    if a.messages:
        try:
            messages = json.loads(open(a.messages).read())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"--messages {a.messages}: not a readable JSON file ({e})") from None
    generator = load(a.source, a.checkpoint, a.device)
    print(generator(a.prompt, sampling, chat=a.chat, messages=messages, system=a.system), flush=True)
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


COMMANDS = {"train": _train, "plan": _plan, "export": _export, "generate": _generate, "report": _report, "hw": _hw}


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
    except Interrupted as e:
        print(_interrupted_line(e, argv), file=sys.stderr)
        return 128 + e.signum
    except SaveFailed as e:
        print(f"holotrain: error: {e}", file=sys.stderr)
        return 4
    except KeyboardInterrupt:  # Ctrl-C before training installed its own handling (during imports, say)
        print("holotrain: SIGINT: stopped before training started; nothing to save", file=sys.stderr)
        return 130


def _interrupted_line(e: Interrupted, argv: list[str]) -> str:
    """One line: where the run stopped, what it saved, and the command that resumes it (this one, which resumes by
    default; under torchrun, the same torchrun command)."""
    import shlex
    import signal

    name = signal.Signals(e.signum).name
    if e.checkpoint is None:
        return (f"holotrain: {name}: stopped after step {e.step}; its checkpoint could not be written in time "
                "(checkpoint.interrupt_grace_s), the newest earlier one resumes")
    args = [a for a in argv if a.split("=", 1)[0] != "--checkpoint.resume"]
    command = ("the same torchrun command" if int(os.environ.get("WORLD_SIZE", "1")) > 1
               else "holotrain " + shlex.join(args))
    return f"holotrain: {name}: stopped after step {e.step}, saved {e.checkpoint}; resume with: {command}"


if __name__ == "__main__":
    sys.exit(main())
