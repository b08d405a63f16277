"""``areal-jax bench``: the system benchmarks of issue 14, one module per part.

- ``async_sync``: asynchronous RL against synchronous on the same config, seed and steps, with
  rollout and trainer on disjoint CPU cores (the synchronous baseline gets every core per phase).
- ``staleness``: naive PPO against decoupled PPO at several ``max_staleness`` (AReaL Table 2).
- ``interrupt``: weight updates that interrupt answers in flight against ones that wait for them.
- ``components``: the component benchmarks in ``benchmarks/`` under the same entry.

Each part writes ``<out>/<part>.json`` and PNG plots; ``cli.main`` is the command.
"""

PARTS = ("async", "staleness", "interrupt", "components")
