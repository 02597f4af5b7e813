"""The policies' option defaults, each typed once (a leaf: no imports, so the config, the balancer
and the registry all read the same numbers without importing one another).

- ``BALANCER_DEFAULTS``: the ElChe balancer's (``--anchor``, ``--max-anchor``,
  ``--overhead-target``; SPEC §4): the slowest rank's first window, batches; the anchor's
  ceiling, batches (never below the anchor); the round overhead (round ms / the anchor
  rank's window ms) past which the anchor grows.
- ``ADOPTION_DEFAULTS``: ``async``'s adoption (``--async-adopt``, ``--easgd-alpha``): delta,
  and EASGD's pull when easgd is chosen.
"""

from __future__ import annotations

from types import MappingProxyType

__all__ = ["ADOPTION_DEFAULTS", "BALANCER_DEFAULTS"]

BALANCER_DEFAULTS = MappingProxyType({"anchor": 10, "max_anchor": 1000, "overhead_target": 0.05})
ADOPTION_DEFAULTS = MappingProxyType({"async_adopt": "delta", "easgd_alpha": 0.5})
