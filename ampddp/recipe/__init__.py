"""A training run from a recipe: ``reading`` turns YAML and overrides into a checked RunConfig,
``factories`` maps its sections to objects, ``checks`` validates a recipe before anything is written,
``schedule`` holds the LR schedules with warmup, ``run`` trains it here or in spawned processes."""
