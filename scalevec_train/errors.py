"""The one exception type for bad user input: configs, data, checkpoints.

Entry points catch it, print its message on one line and exit non-zero, so that a user sees what is
wrong and how to fix it instead of a traceback.
"""


class ScalevecError(Exception):
    """Bad input. `where` names the config key or file; `fix` says what to do about it."""

    def __init__(self, where: str, problem: str, fix: str = ""):
        self.where, self.problem, self.fix = where, problem, fix
        msg = f"{where}: {problem}"
        if fix:
            msg += f" Fix: {fix}"
        super().__init__(msg)
