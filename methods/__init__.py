"""Sequence-parallel attention methods behind one interface (docs/DESIGN.md section 4).

    import methods
    methods.available()                      # ["reference", "ring", "ulysses", ...]
    m = methods.get_method("ring", kernel="auto")
    out = m.attention(q_local, k_local, v_local, causal=True, comm=comm)

This package never imports `suite` or Hydra.
"""

# Own methods register themselves on import.
from methods import (  # noqa: E402,F401
    allgather_kv,
    burst,
    dispatch,
    peers,  # noqa: E402,F401  (registered only where the library imports)
    reference,
    ring,
    stripe_ring,
    tasp,
    token_ring,
    ulysses,
    usp,
    zigzag_ring,
)
from methods.base import Case, Method, SPAttention
from methods.registry import (
    GROUPS,
    available,
    expand_groups,
    get_method,
    group_members,
    load_plugins,
    method_class,
    register,
    register_unavailable,
    unavailable,
)

__all__ = [
    "GROUPS",
    "Case",
    "Method",
    "SPAttention",
    "available",
    "expand_groups",
    "get_method",
    "group_members",
    "load_plugins",
    "method_class",
    "register",
    "register_unavailable",
    "unavailable",
]
