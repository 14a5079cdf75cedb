"""The old home of the registered functions, kept because the API reference named it
(``ampddp.precision.registry.OpRegistry``): they live in ``ampddp.precision.casting.registry`` now, beside the
casts they decide; ``ampddp.OpRegistry`` and the decorators on ``ampddp`` are the public names."""

from ampddp.precision.casting.registry import *  # noqa: F403 - the same public names as there
from ampddp.precision.casting.registry import __all__  # noqa: F401
