"""XLA flags for the tests' programs, which are tiny and compiled once or a few times each: XLA's
LLVM optimisation passes cost more (about a third of a compile-heavy test's time) than they save.
The HLO passes, which decide the numerics, are the same as at the default level. Child processes
that mostly compile (a few steps each) take them too; ones that run many steps do not, since the
unoptimised code runs slower."""

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def devices(n: int) -> str:
    """``XLA_FLAGS`` for ``n`` fake CPU devices, compiled fast."""
    return f"--xla_force_host_platform_device_count={n} {FAST_COMPILE}"
