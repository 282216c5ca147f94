"""The `megascale` command. Each subcommand lives beside the code it drives.

A subcommand module defines `add_arguments(parser)` and `run(args) -> int`; it is imported only
when used, so `megascale plan` does not pay for the trainer's imports.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("megascale.train.cli", "train a model (one process, torchrun, or --nproc N local ranks)"),
    "prep": ("megascale.data.cli", "tokenise text/JSONL/Parquet/Arrow (compressed, fsspec URLs) into token shards"),
    "data": ("megascale.data.inspection", "look into prepared token directories: data inspect DIR"),
    "plan": ("megascale.plan.cli", "predict step time, MFU and memory; choose a layout"),
    "launch": ("megascale.resilience.driver.cli", "run a job under the fault-tolerant driver"),
    "executor": ("megascale.resilience.executor.cli", "run a node's executor (started by a scheduler)"),
    "selfcheck": ("megascale.resilience.selfcheck.cli", "run node and network self-checks"),
    "secret": ("megascale.resilience.common.credentials", "make a job's secret: tokens, TLS certificate and key"),
    "report": ("megascale.diagnostics.cli", "analyse a run: heat map, stragglers, hangs, timeline"),
    "export": ("megascale.interop.export_cli", "write a checkpoint as a Hugging Face model directory"),
    "generate": ("megascale.interop.generate_cli", "text from a checkpoint or a Hugging Face model directory"),
    "import": ("megascale.interop.import_cli", "the config that trains on from a Hugging Face checkpoint directory"),
}
CONFIG_COMMANDS = {"train", "launch", "plan", "import"}  # take --section.key=value overrides of the job config


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="megascale", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            parser.error(f"unknown command {argv[0]!r}; choose from {', '.join(SUBCOMMANDS)}")
        parser.print_help()
        return 0 if argv else 2
    name = argv[0]
    module = importlib.import_module(SUBCOMMANDS[name][0])
    config = name in CONFIG_COMMANDS
    cmd_parser = argparse.ArgumentParser(
        prog=f"megascale {name}", description=SUBCOMMANDS[name][1], add_help=not config
    )
    module.add_arguments(cmd_parser)
    if config:
        cmd_parser.add_argument(
            "-h",
            "--help",
            nargs="?",
            const="",
            metavar="SECTION",
            help="show this help and every config key (of one SECTION: e.g. model)",
        )
    args, extra = cmd_parser.parse_known_args(argv[1:])
    if config and args.help is not None:
        from megascale.config.help import config_help

        print(cmd_parser.format_help())
        print(config_help(args.help or None))
        return 0
    args.overrides, leftover = split_overrides(extra)
    if leftover:
        cmd_parser.error(f"unrecognised arguments: {' '.join(leftover)}")
    return int(module.run(args) or 0)


def split_overrides(extra: list[str]) -> tuple[list[str], list[str]]:
    """`--a.b=v` and `--a.b v` as `--a.b=v` overrides; whatever else is left over."""
    overrides, leftover, i = [], [], 0
    while i < len(extra):
        arg = extra[i]
        if arg.startswith("--") and "=" in arg:
            overrides.append(arg)
        elif arg.startswith("--") and "." in arg and i + 1 < len(extra) and not extra[i + 1].startswith("--"):
            overrides.append(f"{arg}={extra[i + 1]}")
            i += 1
        else:
            leftover.append(arg)
        i += 1
    return overrides, leftover


if __name__ == "__main__":
    sys.exit(main())
