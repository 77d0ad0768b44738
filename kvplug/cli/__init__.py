"""The ``kvplug`` command line, one module per command group.

Exit codes: 0 success, 2 a bad config or usage, 3 a plugin error. Errors are one line on
stderr; ``--debug`` shows the traceback.
"""

from __future__ import annotations

from . import config, plugins, serve_example, simulate  # noqa: F401  (each module registers its commands on ``app``)
from .app import app

__all__ = ["app", "main"]


def main() -> None:
    """Console-script entry point."""
    app()
