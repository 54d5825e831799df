"""The one compiled part: the list scheduler's kernel (``chameleon_ft.perf._listsched``).

Everything else is in pyproject.toml. The extension is optional: where no C compiler is
found the package installs without it and the scheduler runs its Python reference (the
same results, slower; ``chameleon_ft.perf.kernel.COMPILED`` tells which one runs).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "chameleon_ft.perf._listsched",
    sources=["src/chameleon_ft/perf/_listsched.c"],
    # No contraction of a * b + c into one rounding: the kernel must round exactly as
    # Python does, so that both give bit-identical timelines.
    extra_compile_args=["-O2", "-ffp-contract=off", "-fno-fast-math"],
    optional=True,
)])
