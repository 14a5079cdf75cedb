"""The run directory: its files written without following links (``files``), the lock that keeps one run
in it (``lock``), settings' paths expanded (``paths``). Torch-free: the CLI reads it before torch loads.
It imports nothing of ampddp above the foundations (a finished run answering its rerun, which reads a
checkpoint's manifest, is the recipe's: ``ampddp.recipe.finished``)."""
