"""Exception types, the exit statuses they end a command with, and message helpers shared by every ampddp module.

Errors name what the user passed and what would have been valid, so a bad setting is fixed from
the message alone, without reading ampddp's source.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable, Sequence

EXIT_FAILED = 1
"""The run failed for a reason of its own that the same command would meet again (out of memory, named
with the phase and batch), as Python reports an uncaught error."""
EXIT_USAGE = 2
"""A bad recipe, setting, path or checkpoint, or a torch older than ampddp supports (refused before anything was
written), or a sample of the data that cannot be used (named; checkpoints already written stay)."""
EXIT_NONFINITE = 3
"""Training stopped because the loss or gradients stayed non-finite (NonFiniteGradientsError)."""
EXIT_PEER_FAILURE = 4
"""Another rank died or stopped responding (PeerFailureError); the same command resumes the run."""
EXIT_IO = 5
"""Writing the run's files failed (disk full, I/O error, read-only file system): retryable. Nothing
acknowledged is lost; the same command resumes from the newest complete checkpoint once fixed."""

_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def escape_controls(text: str) -> str:
    """``text`` with control characters (and bidirectional overrides) written as escapes: an echoed
    key, value or path with ``\\x1b`` in it must not drive the terminal that shows the error."""
    return _CONTROLS.sub(lambda found: f"\\x{ord(found[0]):02x}" if ord(found[0]) < 256 else f"\\u{ord(found[0]):04x}", text)


def shown(value: object, limit: int = 40) -> str:
    """``repr(value)`` for a one-line message, cut short with its length where longer than ``limit``
    (an integer of thousands of digits, a long list)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit // 2]}... ({len(text)} characters)"


class ConfigError(ValueError):
    """A setting has a value ampddp cannot use; raised before any work or state change."""


class ArgumentTypeError(ConfigError, TypeError):
    """A library call (``prepare``, the Trainer) got an argument of a type it does not take: refused at
    the door, before any work, where it otherwise failed deep inside (``'str' object has no attribute
    'device'``). A ConfigError (the CLI's one line) that ``except TypeError`` catches as well."""


def wrong_type(argument: str, value: object, takes: str) -> ArgumentTypeError:
    """The standard 'this argument got a value of the wrong type, it takes ...' error."""
    shown = " ".join(repr(value).split())  # one line: an optimizer's repr spans several
    shown = shown if len(shown) <= 60 else f"{shown[:57]}..."
    return ArgumentTypeError(f"{argument}={escape_controls(shown)} ({type(value).__name__}) is not valid; valid: {takes}")


class AmpUsageError(RuntimeError):
    """The amp API was called in an order or with objects it cannot handle safely."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the file and what is wrong."""


class DataError(ValueError):
    """A sample of the data cannot be used (its loading raised, or its label is outside the model's
    classes); the message names the sample and the original error.

    Raised in a DataLoader worker, it comes back wrapped in the worker's traceback; only the last
    line, this error's own message, is kept, so the report stays one line."""

    def __init__(self, message: str) -> None:
        lines = [line for line in str(message).splitlines() if line.strip()]
        own = f"{type(self).__module__}.{type(self).__qualname__}: "
        last = lines[-1] if lines else str(message)
        super().__init__(last[len(own) :] if last.startswith(own) else str(message))


class BadSamplesError(DataError):
    """Samples of a batch hold bad values (a label outside the model's classes), found where only
    their rows in the batch are known. ``describe(samples)`` is the message for the samples named in
    words; whoever knows which dataset samples the batch holds (the training loop, the evaluator)
    raises ``named(...)`` instead, so the user is told the dataset indices to look at."""

    def __init__(self, describe: Callable[[str], str], rows: Sequence[int]) -> None:
        self.describe, self.rows = describe, tuple(rows)
        super().__init__(describe(f"batch position(s) {listed(self.rows)}"))

    def __reduce__(self) -> tuple[type[DataError], tuple[str]]:
        return DataError, (str(self),)  # the message travels; the describer stays where it was made

    def named(self, samples: str) -> DataError:
        """The same report with ``samples`` (e.g. "training sample(s) 37 (epoch 0)") naming the rows."""
        return DataError(self.describe(samples))


def listed(numbers: Iterable[int], limit: int = 8) -> str:
    """``numbers`` sorted, comma-separated, the first ``limit`` shown: for naming samples in one line."""
    shown = sorted(numbers)
    return ", ".join(map(str, shown[:limit])) + (", ..." if len(shown) > limit else "")


class RunIOError(RuntimeError):
    """Writing a run's files failed (disk full, I/O error, file system gone read-only). Retryable:
    everything acknowledged is on disk, and the same command resumes from the newest complete
    checkpoint once the file system is fixed."""


class CheckpointWriteError(CheckpointError, RunIOError):
    """A checkpoint could not be written (the previous complete one is untouched)."""


class PeerFailureError(RuntimeError):
    """A collective failed because another rank died or stopped responding."""


class RendezvousError(PeerFailureError):
    """The ranks could not join one process group (a peer never arrived, the rendezvous address does
    not answer); nothing of the run was written yet."""


class OutOfMemoryError(RuntimeError):
    """The run ran out of host or GPU memory; the message names the phase of the step and the batch."""


class UnsupportedTorchError(RuntimeError):
    """The installed torch is older than ampddp supports, or lacks an internal API a feature needs;
    the message names the version needed and what to do instead."""


class NonFiniteGradientsError(RuntimeError):
    """Gradients stay non-finite however far the loss scale backs off: training cannot progress."""


def closest(name: str, choices: Iterable[str]) -> str:
    """Return ' (did you mean X?)' for the choice nearest to ``name``, or '' when none is near."""
    match = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


def spelled(choice: object) -> str:
    """A choice as a recipe spells it: YAML's ``true`` / ``false`` for booleans."""
    return str(choice).lower() if isinstance(choice, bool) else str(choice)


def choice_error(what: str, value: object, choices: Iterable[object]) -> ConfigError:
    """Build the standard 'bad value, valid values are ...' error."""
    options = [spelled(choice) for choice in choices]
    hint = closest(str(value), options)
    return ConfigError(f"{what}={value!r} is not valid{hint}; valid choices: {', '.join(options)}")
