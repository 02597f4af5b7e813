"""A test-only policy, registered by the tests (never by the product): a round after every 4
batches of each rank, blocking. It plans what ``--policy window --window 4`` plans, through a
class and an entry of its own, so a run under it must give that run's rounds and consensus.

What a new policy takes (README, "Adding a policy"): a :class:`~flodl_mpi.policy.policies.Policy`
with a ``plan()``, and one :class:`~flodl_mpi.policy.registry.PolicySpec`, registered on every rank
before the config is built (a launch: a script that registers it, then calls the CLI's ``main``).
"""

from __future__ import annotations

from flodl_mpi.policy.policies import Plan, Policy
from flodl_mpi.policy.registry import PolicySpec, count, lookup, register, unregister

NAME, EVERY = "every4", 4


class EveryFour(Policy):
    """Every rank trains `EVERY` batches per window; the anchor is that window."""

    def plan(self) -> Plan:
        return Plan((EVERY,) * self.world_size, EVERY)


SPEC = PolicySpec(NAME, blocking=True, help=f"after every {EVERY} batches (a test's toy)",
                  words=lambda values, unit: f"a round after every {count(EVERY, unit)}",
                  build=lambda cfg, world_size: EveryFour(world_size))


def register_toy() -> None:
    """Register `SPEC` (once per process)."""
    if lookup(NAME) is None:
        register(SPEC)


def unregister_toy() -> None:
    """Remove it again (the registry is the process's: other tests must not see it)."""
    unregister(NAME)
