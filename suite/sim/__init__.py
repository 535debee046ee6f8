"""The simulator (DESIGN.md section 10). So far: `trace`, which records the schedule a method's
own code executes (compute blocks, messages and their waits) per rank, without arithmetic."""
