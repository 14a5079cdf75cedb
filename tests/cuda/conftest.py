"""Every test in tests/cuda/ needs a CUDA GPU: marked ``cuda`` and skipped, with the reason, without one.

On a GPU machine: ``python -m pytest tests/cuda`` (or ``-m cuda`` for every CUDA test in the suite).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(pytest.mark.cuda)
            if not torch.cuda.is_available():
                item.add_marker(skip)
