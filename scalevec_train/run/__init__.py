"""A run's wiring: where it starts, its run directory, the config built into a trainer, resumes and
branches, the run directories of sweeps; and the commands' work: their one command line (cli.py), a
checkpoint's evaluation (checkpoint_eval.py), the checksums of a folder's files (audit.py)."""
