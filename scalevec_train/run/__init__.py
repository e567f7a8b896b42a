"""A run's wiring: the config built into a trainer, resumes and branches, and the run directories of sweeps."""
