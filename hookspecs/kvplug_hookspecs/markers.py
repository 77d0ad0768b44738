"""The pluggy markers of the kvplug project.

Plugins import ``hookimpl`` from here (or from ``kvplug``) to mark their hook implementations.
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "kvplug"
"""The pluggy project name, and the entry-point group plugins register under."""

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
