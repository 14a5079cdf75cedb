"""The run directory: its files written without following links (``files``), the lock that keeps one run
in it (``lock``), settings' paths expanded (``paths``) and the check that a finished run answers its
rerun (``finished``). Torch-free: the CLI reads it before torch loads."""
