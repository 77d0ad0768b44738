"""The engine side of kvplug: the reference scheduler and the example models it drives."""
