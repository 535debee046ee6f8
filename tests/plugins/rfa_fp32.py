"""Test-only plugin: the ring-flash-attn CPU test double (rfa_cpu_shim) with the adapters' fp32
skip lifted, to show the upstream fp32 gradient bug the skip exists for."""

import tests.plugins.rfa_cpu_shim  # noqa: F401  (installs the test double, registers rfa_*)
from methods.peers import ring_flash_attn_peer
from methods.peers.base import PeerMethod

ring_flash_attn_peer._RFA.supports = lambda self, case: PeerMethod.supports(self, case)
