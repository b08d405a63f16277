"""XLA flags for the tests' programs, which are tiny and compiled once or a few times each: XLA's
LLVM optimisation passes cost more (about a third of a compile-heavy test's time) than they save.
The HLO passes are the same as at the default level, but the floats are not bit for bit the same:
the demo's 190-step warm start ended at loss 0.566 with these flags against 0.510 without them
(one run each, 2026-11-28), so results are only compared between runs with the same flags.
Child processes that mostly compile (a few steps each) take them too; ones that run many steps do
not, since the unoptimised code runs slower: that demo run took 229 user CPU-s with them against
157 without (both beside a test suite run).

XLA:CPU's newer fusion emitters compile a fused computation through MLIR before LLVM: on these
programs that is over half of the compile. Without them the fusions are emitted as before them
(the same HLO, fused the same way), and a tiny trainer's first step (grad, apply and advantages
compiled) took 2.6-2.8 s against 6.0-8.0 s, its later steps as fast, its loss the same; one codegen
split instead of several is a little faster again on a machine whose cores are all busy."""

FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1")


def devices(n: int) -> str:
    """``XLA_FLAGS`` for ``n`` fake CPU devices, compiled fast."""
    return f"--xla_force_host_platform_device_count={n} {FAST_COMPILE}"
