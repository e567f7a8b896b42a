"""The exception the kernels raise for a call they cannot serve, so that the library needs no
framework."""


class KernelError(ValueError):
    """Bad arguments, or a backend that cannot run here. `problem` says what is wrong, `fix` what to
    do.

    A ValueError, so that callers catching bad arguments in general catch it too; a framework can
    turn it into its own error type from the two parts.
    """

    def __init__(self, problem: str, fix: str):
        self.problem, self.fix = problem, fix
        super().__init__(f"{problem} Fix: {fix}")
