"""`python -m suite advise`: which method and degrees for a model's attention, a cluster and a length mix.

question (model shape, topology x nodes, length, length mix, memory budget, pass)
-> candidates: every own method of the registry x the values of its options that shape the
   configuration (Ulysses degree, ranks per node of a two-level ring, sharding of packed documents)
-> pruned before anything is traced: what the method refuses for the case (degrees vs world size
   and heads, layout granules), no backward, a memory estimate over the budget (suite/sim/memory.py)
-> the survivors run as one ordinary simulated sweep (the runner with executor=sim: rows stored under
   results/, logged to MLflow, schedules traced once per shape by the trace cache)
-> ranked by predicted time, with percent of ideal (single-device time / P on the same compute
   model), memory per GPU, and the main cost read from the row's time split.

Candidates come from `methods.available()`, so a newly registered method is weighed without a change
here; only option *names* are known here (`candidates.OPTION_VALUES`), never method names.

The package reads in that order, one module a stage: `question` (the inputs, validated; AdviceError),
`candidates` (enumerated and pruned), `ranking` (the simulated sweep, ranked: `advise`), `output`
(the sentence, the table, the files, the sweep that measures the top), `compare` (against a measured
run), `command` (the command line). The names below are what the rest of the suite and the tests use.
"""

from suite.advise.candidates import OPTION_VALUES, Candidate, candidate_methods, enumerate_candidates, plain_name, prune
from suite.advise.command import command_line, run_command
from suite.advise.compare import compare, ranks_of, spearman
from suite.advise.output import (
    advice_sentence,
    counts_line,
    emit_config,
    evidence_line,
    header,
    measure_count,
    next_step,
    pruned_lines,
    render,
    tie_line,
    write_outputs,
)
from suite.advise.question import (
    GB,
    AdviceError,
    ModelShape,
    Question,
    available_models,
    layer_pattern,
    load_model,
    load_workload,
    make_question,
)
from suite.advise.ranking import (
    MAIN_COST_SHARE,
    Advice,
    advise,
    build_config,
    ideal_ms,
    main_cost,
    merge_same_schedules,
    model_ideal_ms,
    sweep_name,
    tied_with_best,
    total_row,
    within_bands,
)

__all__ = [
    "GB",
    "MAIN_COST_SHARE",
    "OPTION_VALUES",
    "Advice",
    "AdviceError",
    "Candidate",
    "ModelShape",
    "Question",
    "advice_sentence",
    "advise",
    "available_models",
    "build_config",
    "candidate_methods",
    "command_line",
    "compare",
    "counts_line",
    "emit_config",
    "enumerate_candidates",
    "evidence_line",
    "header",
    "ideal_ms",
    "layer_pattern",
    "load_model",
    "load_workload",
    "main_cost",
    "make_question",
    "measure_count",
    "merge_same_schedules",
    "model_ideal_ms",
    "next_step",
    "plain_name",
    "prune",
    "pruned_lines",
    "ranks_of",
    "render",
    "run_command",
    "spearman",
    "sweep_name",
    "tie_line",
    "tied_with_best",
    "total_row",
    "within_bands",
    "write_outputs",
]
