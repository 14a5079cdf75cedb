"""Found as top-level ``apex`` in processes started under ``python -m ampddp.apex``: installs the alias
hook and puts ``ampddp.apex`` in this module's place, so ``import apex`` gives ampddp's stand-in."""

import sys

import ampddp.apex
from ampddp.apex.aliasing import adopt_runner_scope, alias_apex

alias_apex()
adopt_runner_scope()
sys.modules[__name__] = ampddp.apex
