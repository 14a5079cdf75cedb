"""``python -m ampddp.apex [--local-rank N] SCRIPT [ARGS...]`` or ``... -m MODULE [ARGS...]``.

Runs an apex-era program unchanged, with ``import apex`` resolving to ``ampddp.apex``: ``sys.argv``,
``__main__`` and ``sys.path[0]`` are what ``python SCRIPT`` (or ``python -m MODULE``) would give.
Works as the program of ``torchrun ... -m ampddp.apex SCRIPT`` and of the old
``python -m torch.distributed.launch ... -m ampddp.apex SCRIPT``, whose ``--local-rank=N`` is
passed on to the script in the spelling it parses (apex-era scripts: ``--local_rank``).
"""

from __future__ import annotations

import sys

from ampddp.apex.runner import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
