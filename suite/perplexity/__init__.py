"""Model-level equivalence (`kind: perplexity`): a small LLaMA-style model trained with each method
against the same model trained on one device (data.py, model.py, train.py, trial.py, hf.py)."""
