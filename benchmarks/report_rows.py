"""Write a results folder of N synthetic-but-valid rows for timing `suite report` (issue 38: a
report of 10,000 rows in under a minute on 2 cores).

Each row is a real row of a small sweep's folder (SOURCE: a run folder of a threads or dist sweep),
copied with a new key and other identity values on the axes a large sweep varies (method, world
size, sequence length, heads, dtype, pass), so the report sees as many groups as a sweep that size.

    python benchmarks/report_rows.py SOURCE_RUN_DIR OUT_RUN_DIR [N]
    time python -m suite report OUT_RUN_DIR --no-mlflow --out /tmp/report_10k
"""

from __future__ import annotations

import hashlib
import itertools
import json
import shutil
import sys
from pathlib import Path

AXES = {
    "method": ["ring", "zigzag_ring", "ulysses", "allgather_kv", "usp", "stripe_ring", "burst", "tasp"],
    "world_size": [2, 4, 8, 16],
    "seq_len": [4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288],
    "heads": [8, 32],
    "dtype": ["bfloat16", "float16"],
    "pass": ["fwd", "fwd_bwd"],
}


def main() -> None:
    source, out = Path(sys.argv[1]), Path(sys.argv[2])
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 10_000
    real = [json.loads(line) for line in (source / "trials.jsonl").read_text().splitlines() if line.strip()]
    real = [r for r in real if r.get("status") == "ok"]
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.yaml", "environment.json"):
        shutil.copy(source / name, out / name)
    points = itertools.cycle(itertools.product(*AXES.values()))
    with open(out / "trials.jsonl", "w") as f:
        for i in range(n):
            row = dict(real[i % len(real)])
            row.update(zip(AXES, next(points)))
            row["kv_heads"] = row["heads"]
            scale = row["seq_len"] / 64 * (1 + (i % 7) / 10)  # timings grow with the length, as measured would
            for col, value in list(row.items()):  # every time of the row alike: medians stay inside their samples
                if col.endswith("_ms") or col.startswith("time_ms_") and isinstance(value, (int, float)):
                    row[col] = value * scale if isinstance(value, (int, float)) else value
            row["time_ms_samples"] = [v * scale for v in row.get("time_ms_samples") or []]
            row["key"] = hashlib.sha256(f"{i}".encode()).hexdigest()[:16]
            f.write(json.dumps(row) + "\n")
    print(f"wrote {n} rows to {out / 'trials.jsonl'}")


if __name__ == "__main__":
    main()
