"""Checkpoints: the manager that saves and loads a run's stateful objects (manager.py, built from
the options of config.py), and the layout and checks of a checkpoint on disk that resume, load() and
export share (files.py)."""
