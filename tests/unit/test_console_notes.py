"""What a run says while it is built: its notes printed once it is built and its run dir claimed,
dropped when it is refused on the way (the refusal is one line); warnings pass at once."""

from __future__ import annotations

import io
import logging

import pytest

from ampddp.errors import ConfigError
from ampddp.observe.console import notes_held_until_done


@pytest.fixture
def printed():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def test_notes_print_after_a_build_that_succeeds_and_warnings_at_once(printed):
    log = logging.getLogger("ampddp.precision")
    with notes_held_until_done():
        log.info("precision auto -> O0 on cpu")
        log.warning("checkpoint step 4 does not verify, skipped")
        assert printed.getvalue() == "checkpoint step 4 does not verify, skipped\n"
    assert printed.getvalue() == "checkpoint step 4 does not verify, skipped\nprecision auto -> O0 on cpu\n"
    log.info("after")
    assert printed.getvalue().endswith("after\n")


def test_notes_of_a_refused_build_are_dropped(printed):
    with pytest.raises(ConfigError), notes_held_until_done():
        logging.getLogger("ampddp.precision").info("precision auto -> O0 on cpu")
        raise ConfigError("trainer.run_dir=/x is held by another run")
    logging.getLogger("ampddp").info("next")
    assert printed.getvalue() == "next\n"


def test_the_command_console_keeps_other_libraries_notes_and_deprecations_off_and_their_warnings_on():
    from ampddp.observe.command_console import OwnNotesOnly

    def passes(name: str, level: int, message: str) -> bool:
        return OwnNotesOnly().filter(logging.LogRecord(name, level, __file__, 1, message, None, None))

    assert passes("ampddp.trainer", logging.INFO, "step 1") and passes("ampddp.observe", logging.DEBUG, "x")
    assert not passes("mlflow.store.db.utils", logging.INFO, "Creating initial MLflow database tables...")
    assert not passes("torch.utils._pytree", logging.WARNING, "Calling register_constant() on Enum subclasses is deprecated")
    assert passes("torch.distributed", logging.WARNING, "a rank is slow")
