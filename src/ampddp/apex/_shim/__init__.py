"""A folder the runner puts on PYTHONPATH so that child processes (``spawn`` multiprocessing,
subprocesses of the program) resolve ``import apex`` to ``ampddp.apex`` too. Not imported as a package."""
