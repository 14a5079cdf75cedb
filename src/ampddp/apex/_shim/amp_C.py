"""Found as top-level ``amp_C`` in processes started under ``python -m ampddp.apex``: ampddp's ops."""

import sys

import ampddp.apex.amp_C
from ampddp.apex.aliasing import adopt_runner_scope, alias_apex

alias_apex()
adopt_runner_scope()
sys.modules[__name__] = ampddp.apex.amp_C
