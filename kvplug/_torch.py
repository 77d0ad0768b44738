"""Import torch once, before any other kvplug module, without its warning about a missing numpy.

torch warns on import when numpy is absent (an install that skipped kvplug's numpy dependency,
which the CPU allocators use for their checks), and the warning would break the CLI's promise of
one-line errors on stderr. The filter is scoped to this
import: the user's own warning filters are left as they were.
"""

from __future__ import annotations

import warnings

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch  # noqa: F401
