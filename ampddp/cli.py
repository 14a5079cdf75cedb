"""``ampddp`` command line: ``ampddp train RECIPE [key=value ...]`` and ``ampddp inspect PATH [--json]``."""

from __future__ import annotations

import argparse
import json
import sys

from ampddp.checkpoint.inspect import format_summary, summarize
from ampddp.config import describe_keys, load_config
from ampddp.errors import AmpUsageError, CheckpointError, ConfigError
from ampddp.preemption import EXIT_PREEMPTED


def _inspect(args: argparse.Namespace) -> int:
    summary = summarize(args.path)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0


def _train(args: argparse.Namespace) -> int:
    import logging

    from ampddp.run import launch

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    summary = launch(load_config(args.recipe, args.overrides))
    print(json.dumps(summary, indent=2))
    return EXIT_PREEMPTED if summary.get("preempted") else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ampddp", description="Mixed-precision training with apex-style opt levels on native PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = commands.add_parser(
        "train",
        help="train from a recipe",
        description="Train from a YAML recipe; dotted key=value arguments override it. Runs unchanged under torchrun.",
        epilog="keys (defaults):\n" + describe_keys(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("recipe", help="recipe YAML file (see recipes/)")
    train.add_argument("overrides", nargs="*", metavar="section.key=value", help="e.g. precision.mode=O2 trainer.max_steps=100")
    train.set_defaults(handler=_train)
    inspect = commands.add_parser(
        "inspect",
        help="summarise a checkpoint",
        description="Print mode, progress, loss scales, world size, parameters and a SHA-256 of the model tensors.",
    )
    inspect.add_argument("path", help="a checkpoint folder (or a file in it), or a run dir for its latest complete checkpoint")
    inspect.add_argument("--json", action="store_true", help="print JSON (with model_sha256) instead of text")
    inspect.set_defaults(handler=_inspect)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (CheckpointError, ConfigError, AmpUsageError) as error:
        print(f"ampddp {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
