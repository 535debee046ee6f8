"""The benchmark harness: config, plan, launch, trials, results, MLflow, reports.

Depends on `methods` only through its registry and the method interface.
"""
