"""A training run from a recipe: ``factories`` maps a RunConfig's sections to objects, ``checks``
validates a recipe before anything is written, ``schedule`` holds the LR schedules with warmup."""
