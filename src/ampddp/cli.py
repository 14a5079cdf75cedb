"""``ampddp`` command line: ``ampddp train RECIPE [key=value ...]``, ``ampddp inspect PATH [--json]``,
``ampddp export PATH --to FILE.safetensors`` and ``ampddp plot RUN_DIR [RUN_DIR ...]``.

Only light modules are imported at the top: ``main`` catches the stop signals before torch loads, and
``--help`` / ``--version`` answer without importing torch at all (the choices they list live in
``ampddp.choices``), and so does ``train`` of a run that has already finished (``ampddp.recipe.finished``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ampddp.choices import EXPORT_DTYPE_NAMES
from ampddp.errors import (
    EXIT_FAILED,
    EXIT_IO,
    EXIT_NONFINITE,
    EXIT_PEER_FAILURE,
    EXIT_USAGE,
    AmpUsageError,
    CheckpointError,
    ConfigError,
    DataError,
    NonFiniteGradientsError,
    OutOfMemoryError,
    PeerFailureError,
    RendezvousError,
    RunIOError,
    UnsupportedTorchError,
    escape_controls,
)
from ampddp.preemption import EXIT_INTERRUPTED, EXIT_PREEMPTED, EarlySignals, StopRequested

EXIT_BROKEN_PIPE = 141
"""stdout was closed early (``ampddp inspect RUN | head``): 128 + SIGPIPE, as a shell tool reports it."""


def _inspect(args: argparse.Namespace, early: EarlySignals) -> int:
    early.release()  # no signal stops an inspection cleanly: each acts as it would without ampddp
    from ampddp.checkpoint.inspect import format_summary, summarize

    summary = summarize(args.path)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0


def _export(args: argparse.Namespace, early: EarlySignals) -> int:
    early.release()
    from ampddp.checkpoint.export import export_weights, format_export

    print(format_export(export_weights(args.path, args.to, dtype=args.dtype, force=args.force)))
    return 0


def _plot(args: argparse.Namespace, early: EarlySignals) -> int:
    early.release()
    import importlib.util

    from ampddp.observe.plots import plot_comparison, plot_metrics
    from ampddp.rundir.files import METRICS_FILE
    from ampddp.rundir.paths import refuse_long_names

    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("ampddp plot needs matplotlib: pip install 'ampddp[plots]'")
    for run_dir in args.run_dirs:
        refuse_long_names(run_dir, "RUN_DIR")
        if not (Path(run_dir) / METRICS_FILE).is_file():
            raise ConfigError(f"{run_dir}: no {METRICS_FILE} here; name the run dir of an ampddp run (trainer.run_dir)")
    if len(args.run_dirs) == 1 and args.to is None:
        written = plot_metrics(args.run_dirs[0])
    else:
        out = Path(args.to or "comparison.png")
        refuse_long_names(out, "--to")
        if out.suffix != ".png" or out.is_dir():
            raise ConfigError(f"--to {out}: name the output file *.png")
        if (out.exists() or out.is_symlink()) and not args.force:
            raise ConfigError(f"--to {out} exists; choose another name or pass --force to replace it")
        written = [plot_comparison(args.run_dirs, out)]
    print("\n".join(f"wrote {path}" for path in written if path is not None))
    return 0


def _train(args: argparse.Namespace, early: EarlySignals) -> int:
    from ampddp.choices import LOG_LEVEL_VARIABLE
    from ampddp.observe.command_console import set_up_command_console
    from ampddp.observe.console_streams import write_line
    from ampddp.recipe.finished import finished_run_summary
    from ampddp.recipe.path_checks import check_paths
    from ampddp.recipe.reading import load_config
    from ampddp.rundir import strict_json

    set_up_command_console(args.verbose)
    if args.verbose:
        os.environ[LOG_LEVEL_VARIABLE] = "DEBUG"  # inherited by the ranks this command starts
    config = load_config(args.recipe, args.overrides)
    check_paths(config)  # what needs only the file system answers before torch loads
    early.release(keep=config.trainer.stop_signals)  # the others act as if never caught
    summary = finished_run_summary(config)  # a finished run answers before torch is imported
    prints = True
    if summary is None:
        from ampddp.distributed.env import detect_env
        from ampddp.recipe.run import launch

        summary = launch(config, early=early)
        prints = detect_env(device="cpu").is_main  # under a launcher every rank returns it; one prints
    if prints:
        write_line(strict_json.dumps(summary, indent=2))  # a closed or full stdout ends the output, not a trained run's success
    if not summary.get("preempted"):
        return 0
    return EXIT_INTERRUPTED if summary["preempted"] == "SIGINT" else EXIT_PREEMPTED


def _version() -> str:
    """The installed distribution's version, read from its metadata (no torch import)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ampddp")
    except PackageNotFoundError:
        return "unknown (not installed; running from a source tree)"


def build_parser() -> argparse.ArgumentParser:
    from ampddp.recipe.key_docs import describe_keys

    parser = argparse.ArgumentParser(prog="ampddp", description="Mixed-precision training with apex-style opt levels on native PyTorch.")
    parser.add_argument("--version", action="version", version=f"ampddp {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = commands.add_parser(
        "train",
        help="train from a recipe",
        description="Train from a YAML recipe; dotted key=value arguments override it. Runs unchanged under torchrun.",
        epilog="keys = default {valid values}, and what each does (ampddp train --help SECTION: one section):\n" + describe_keys(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("recipe", help="recipe YAML file (see recipes/)")
    train.add_argument("overrides", nargs="*", metavar="section.key=value", help="e.g. precision.mode=O2 trainer.max_steps=100")
    train.add_argument("--verbose", action="store_true", help="also debug records and other libraries' notes")
    train.set_defaults(handler=_train)
    inspect = commands.add_parser(
        "inspect",
        help="summarise a checkpoint",
        description="Print mode, progress, loss scales, world size, parameters and a SHA-256 of the model tensors.",
    )
    inspect.add_argument("path", help="a checkpoint folder (or a file in it), or a run dir for its newest checkpoint that verifies")
    inspect.add_argument("--json", action="store_true", help="print JSON (with model_sha256) instead of text")
    inspect.set_defaults(handler=_inspect)
    export = commands.add_parser(
        "export",
        help="write a checkpoint's model weights as safetensors",
        description="Write the model weights of a verified checkpoint (whole tensors, from any strategy and world size) "
        "to a safetensors file whose metadata holds the precision mode and policy, the step and the versions.",
    )
    export.add_argument("path", help="a checkpoint folder (or a file in it), or a run dir for its newest checkpoint that verifies")
    export.add_argument("--to", required=True, metavar="FILE.safetensors", help="the file to write (atomically)")
    export.add_argument("--dtype", default="saved", choices=EXPORT_DTYPE_NAMES, help="floating tensors as saved (default) or cast")
    export.add_argument("--force", action="store_true", help="replace FILE if it exists")
    export.set_defaults(handler=_export)
    plot = commands.add_parser(
        "plot",
        help="plot runs from their metrics.jsonl",
        description="One run dir: (re)write its plots and report.png there. Several (or --to): their curves overlaid on one "
        "page (loss, evaluation metrics, learning rate, loss scale), e.g. the same recipe in two precision modes.",
    )
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run dirs of ampddp runs (trainer.run_dir)")
    plot.add_argument("--to", metavar="FILE.png", help="the comparison page to write (default: comparison.png here)")
    plot.add_argument("--force", action="store_true", help="replace FILE if it exists")
    plot.set_defaults(handler=_plot)
    return parser


def _one_line(error: BaseException) -> str:
    """The error's message on one line, its control characters escaped (a key or path with ESC in it
    must not drive the user's terminal)."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__
    return escape_controls(text)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail on the closed pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real file descriptor (e.g. captured in tests)
        pass


def _run(args: argparse.Namespace, early: EarlySignals) -> int:
    try:
        return args.handler(args, early)
    except RunIOError as error:  # before CheckpointError: a checkpoint that could not be written is this kind
        then = "the same command resumes from the newest complete checkpoint" if args.command == "train" else "run it again"
        print(f"ampddp {args.command}: error: {_one_line(error)}; fix the file system or free space, then {then}", file=sys.stderr)
        return EXIT_IO
    except (CheckpointError, ConfigError, AmpUsageError, UnsupportedTorchError, DataError) as error:
        print(f"ampddp {args.command}: error: {_one_line(error)}", file=sys.stderr)
        return EXIT_USAGE
    except RendezvousError as error:  # before PeerFailureError: nothing trained, nothing to resume
        print(f"ampddp {args.command}: error: {_one_line(error)}", file=sys.stderr)
        return EXIT_PEER_FAILURE
    except NonFiniteGradientsError as error:
        print(f"ampddp {args.command}: error: training stopped: {_one_line(error)}", file=sys.stderr)
        return EXIT_NONFINITE
    except OutOfMemoryError as error:
        print(f"ampddp {args.command}: error: training stopped: {_one_line(error)}", file=sys.stderr)
        return EXIT_FAILED
    except PeerFailureError as error:
        print(
            f"ampddp {args.command}: error: training stopped: {_one_line(error)}; "
            "the same command resumes the run from its newest complete checkpoint",
            file=sys.stderr,
        )
        return EXIT_PEER_FAILURE


def _asks_for_a_section(argv: list[str] | None) -> bool:
    """``ampddp train --help SECTION`` (argparse's --help takes no value)."""
    from ampddp.config import SECTIONS

    words = sys.argv[1:] if argv is None else argv
    return len(words) == 3 and words[0] == "train" and words[1] in ("-h", "--help") and words[2] in SECTIONS


def _section_help(section: str) -> int:
    from ampddp.recipe.key_docs import describe_keys

    print(f"{section} keys = default {{valid values}}, and what each does:\n{describe_keys(section)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status: 0, EXIT_FAILED (out of memory), EXIT_USAGE, EXIT_NONFINITE, EXIT_PEER_FAILURE, EXIT_IO,
    EXIT_PREEMPTED, EXIT_INTERRUPTED or EXIT_BROKEN_PIPE.

    Stop signals are caught from the first line, before torch and the recipe load: one that arrives
    before training begins ends the command at once (nothing new to save), with one line and its
    status; ``train`` hands those the recipe names to the run, where they checkpoint and stop.
    """
    with EarlySignals() as early:
        command = "ampddp"
        try:
            if _asks_for_a_section(argv):
                return _section_help((sys.argv[1:] if argv is None else argv)[2])
            args = build_parser().parse_args(argv)
            command = early.command = f"ampddp {args.command}"
            code = _run(args, early)
            sys.stdout.flush()  # a closed pipe fails here, not in the interpreter's exit-time flush
            return code
        except BrokenPipeError:
            _silence_stdout()
            return EXIT_BROKEN_PIPE
        except StopRequested as error:  # a stop signal where there was nothing (more) to save
            print(f"{command}: {_one_line(error)}", file=sys.stderr)
            return error.exit_code
        except KeyboardInterrupt:  # Ctrl-C where no stop signal was configured for it
            print(f"{command}: interrupted (SIGINT)", file=sys.stderr)
            return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
