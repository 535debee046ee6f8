"""The simulator (docs/DESIGN.md section 10), and nothing else: `trace` records the schedule a
method's own code executes (compute blocks, messages and their waits) per rank, without arithmetic,
with the events and recording pieces of `ledger`;
`peers` does the same for a peer library's own code (behind `fake_dist`, a fake torch.distributed,
and `flash_attn_stub`, a flash-attn stand-in); `topology` loads the hardware models; `compute` times
a block; `engine` replays a trace on a topology; `memory` estimates peak memory. The `sim` executor
that runs sweeps on it lives with the other executors (suite/executors/sim.py), the `calibrate`
command with the other commands (suite/calibrate.py)."""
