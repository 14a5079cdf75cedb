"""A training run from a recipe: ``reading`` turns YAML and overrides into a checked RunConfig,
``factories`` maps its sections to objects, ``checks`` checks its values before any part is built,
``build`` builds the run once, in order, checking each part where it is used, ``schedule`` holds the
LR schedules with warmup, ``run`` trains it here or in spawned processes, ``finished`` answers a rerun
of a finished run from its manifest before torch loads."""
