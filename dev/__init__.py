"""The project's maintainer tools (dev/README.md): importable from the repository root, as the tests
import them; not part of the installed packages, and nothing a training run needs."""
