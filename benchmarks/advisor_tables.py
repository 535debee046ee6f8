"""The advisor's answers printed in docs/advisor.md, regenerated: one `suite advise` run per question
(simulated, executor=sim), each question's top three, token_ring's rank and the last configuration,
as a Markdown table on stdout.

    python benchmarks/advisor_tables.py > /tmp/advisor_tables.md

About 45 minutes on 2 cores (2026-11-29; most of it tracing `dispatch` at 16 ranks, 25-37 s a trial on
the two-node questions).

Every number is a prediction with the simulator's validated error band beside it (± %).
"""

import csv
import subprocess
import sys
import tempfile
from pathlib import Path

QUESTIONS = [  # (cluster label, topology, nodes, model, tokens)
    *[("8x H100", "h100_sxm", 1, m, s) for m in ("llama3_8b", "llama3_70b") for s in (32768, 131072, 1048576)],
    *[("8x MI300X", "mi300x", 1, m, s) for m in ("llama3_8b", "llama3_70b") for s in (32768, 131072, 1048576)],
    *[("2x8 H100", "h100_sxm", 2, m, s) for m in ("llama3_8b", "llama3_70b") for s in (131072, 1048576)],
]


def _short(method: str) -> str:
    return method.replace("ulysses_degree=", "u=").replace("(sharding=sequence)", "")


def _cell(row: dict) -> str:
    return f"{_short(row['method'])} {row['degrees']} ({row['predicted ms']} ms ±{row['± %']}%, {row['% of ideal']}%)"


def advise(topology: str, nodes: int, model: str, tokens: int, out: Path) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "suite",
        "advise",
        "--model",
        model,
        "--topology",
        topology,
        "--nodes",
        str(nodes),
        "--seq-len",
        str(tokens),
        "--top",
        "100",
        "--no-mlflow",
        "--results-root",
        str(out / "results"),
        "--out",
        str(out / "advice"),
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out / "advice" / "advice.csv", newline="") as f:
        return list(csv.DictReader(f))


def main() -> None:
    print(
        "| cluster | model | tokens | advised top 3 (predicted ms ± band, % of ideal) | token_ring's rank "
        "(% of ideal) | last (its main cost) |"
    )
    print("|---|---|---|---|---|---|")
    for label, topology, nodes, model, tokens in QUESTIONS:
        with tempfile.TemporaryDirectory() as tmp:
            rows = advise(topology, nodes, model, tokens, Path(tmp))
        top = "; ".join(_cell(r) for r in rows[:3])
        tr = next(r for r in rows if r["method"] == "token_ring")
        last = rows[-1]
        print(
            f"| {label} | {model} | {tokens // 1024}K | {top} | {tr['rank']} ({tr['% of ideal']}%) | "
            f"{_short(last['method'])} ({last['% of ideal']}%, {last['main cost']}) |",
            flush=True,
        )


if __name__ == "__main__":
    main()
