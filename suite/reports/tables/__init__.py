"""Paper-style tables from result rows: flat pandas frames with a column spec (header, unit, number
kind) and a caption drawn from the sweep; `render` writes them as Markdown, LaTeX and HTML, CSV
keeps every column at full precision.

One module a family, each table a function of the rows: `outcomes` (statuses, correctness, skips and
failures), `speed` (throughput, speedup), `costs` (communication, memory), `balance` (load balance,
packed documents, mask families), `checks` (perplexity, simulated vs measured). Beside them `rows`
(the series and the rows tables and figures derive), `captions` (what a caption says of them) and
`cells` (the table model and its text).
"""

from __future__ import annotations

import pandas as pd

from suite.reports.tables.balance import balance, mask_families, packed_vs_uniform
from suite.reports.tables.cells import Table
from suite.reports.tables.checks import perplexity, sim_vs_measured
from suite.reports.tables.costs import communication, memory
from suite.reports.tables.outcomes import correctness_matrix, problems, status_counts
from suite.reports.tables.rows import attention_rows
from suite.reports.tables.speed import speedup, throughput, throughput_pivot


def build_tables(df: pd.DataFrame, baseline: str) -> dict[str, Table]:
    """All tables of a report, by file stem (empty ones are left out by the writer). Attention
    tables use the attention rows; the perplexity table the model-level rows."""
    att = attention_rows(df)
    tables = [
        status_counts(df),
        correctness_matrix(att),
        throughput(att),
        throughput_pivot(att),
        speedup(att, baseline),
        communication(att),
        balance(att),
        packed_vs_uniform(att),
        mask_families(att),
        memory(att),
        perplexity(df),
        sim_vs_measured(att),
        problems(df),
    ]
    return {t.name: t for t in tables}
