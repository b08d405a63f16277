"""Walking traced programs: the tests that count or inspect matmuls share this."""

import jax


def dot_generals(jaxpr: jax.extend.core.Jaxpr) -> list:
    """Every dot_general equation of a jaxpr, sub-jaxprs (scan, remat, pjit) included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.append(eqn)
        for v in eqn.params.values():
            for sub in v if isinstance(v, list | tuple) else [v]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    out += dot_generals(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    out += dot_generals(sub)
    return out
