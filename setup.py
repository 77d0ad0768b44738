"""Build the optional C core of the radix tree and the allocators' checks (kvplug/_speedups.c).

Everything else lives in pyproject.toml. The extension is optional: on a machine without a C
compiler the build warns and kvplug runs on the pure-Python kernels in kvplug/speedups.py.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvplug._speedups",
            sources=["kvplug/_speedups.c"],
            optional=True,
            extra_compile_args=["-O2"],
        )
    ]
)
