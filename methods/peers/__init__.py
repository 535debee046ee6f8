"""Adapters for the peer libraries (docs/DESIGN.md section 4): registered only when the library imports;
otherwise `suite list` shows the reason. Every private or fragile import of a library lives in its
adapter module."""

from methods.peers import ring_flash_attn_peer, torch_cp, yunchang_peer  # noqa: F401
