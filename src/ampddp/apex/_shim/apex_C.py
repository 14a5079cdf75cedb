"""Found as top-level ``apex_C`` in processes started under ``python -m ampddp.apex``: flatten and unflatten."""

import sys

import ampddp.apex.apex_C
from ampddp.apex.aliasing import adopt_runner_scope, alias_apex

alias_apex()
adopt_runner_scope()
sys.modules[__name__] = ampddp.apex.apex_C
