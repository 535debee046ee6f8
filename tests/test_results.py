import json
import math

from suite.results import ResultsStore


def test_append_is_durable_and_torn_tails_are_dropped(tmp_path):
    store = ResultsStore.create(tmp_path, "s", "name: s\n", {"cpu": "x"})
    store.append({"key": "a", "v": 1.0, "nan": float("nan")})
    store.append({"key": "b", "v": 2.0})
    assert (store.run_dir / "config.yaml").read_text() == "name: s\n"
    assert json.loads((store.run_dir / "environment.json").read_text()) == {"cpu": "x"}
    with open(store.trials_path, "a") as f:  # a sweep killed in the middle of a write
        f.write('{"key": "c", "v"')
    assert [r["key"] for r in store.records()] == ["a", "b"]
    assert math.isnan(store.records()[0]["nan"])  # NaN stays a number: not confused with "not checked"
    torn = store.trials_path.read_bytes()
    assert ResultsStore.open(store.run_dir).records() and store.trials_path.read_bytes() == torn  # readers cut nothing
    store.unlock()
    reopened = ResultsStore.open(store.run_dir).lock()  # the next writer cuts the torn tail, under the lock
    reopened.append({"key": "d"})
    assert reopened.completed_keys() == {"a", "b", "d"}
    assert store.trials_path.read_text().count("\n") == 3


def test_latest_run_and_parquet(tmp_path):
    first = ResultsStore.create(tmp_path, "s", "", {})
    second = ResultsStore.create(tmp_path, "s", "", {})  # same second: a distinct folder
    assert first.run_dir != second.run_dir
    assert ResultsStore.latest(tmp_path, "s").run_dir == max(first.run_dir, second.run_dir)
    assert ResultsStore.latest(tmp_path, "other") is None
    second.append({"key": "a", "time_ms_samples": [1.0, 2.0], "x": None, "err": float("inf")})
    second.append({"key": "b", "time_ms_samples": None, "x": 1.5, "err": float("nan")})
    import pandas as pd

    df = pd.read_parquet(second.compact())  # non-finite numbers must not break the Parquet copy
    assert df["key"].tolist() == ["a", "b"] and json.loads(df["time_ms_samples"][0]) == [1.0, 2.0]
    assert df["err"][0] == float("inf") and math.isnan(df["err"][1])


def test_folders_of_one_second_are_distinct_and_listed_newest_first(tmp_path, monkeypatch):
    """A multirun's jobs start in the same second: each gets its own folder, and `-10` is newer
    than `-9` (by name alone it would sort before `-2`)."""
    import datetime as dt

    from suite import results

    class Frozen(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2024, 5, 6, 7, 8, 9)

    monkeypatch.setattr(results, "datetime", Frozen)
    (tmp_path / "s" / "20240506-070809").mkdir(parents=True)  # another job's folder, being created
    stores = [ResultsStore.create(tmp_path, "s", "", {}) for _ in range(10)]
    for s in stores:
        s.unlock()
    names = [s.run_dir.name for s in stores]
    assert len(set(names)) == 10 and "20240506-070809" not in names
    assert [s.run_dir.name for s in ResultsStore.runs(tmp_path, "s")] == names[::-1]
    assert ResultsStore.latest(tmp_path, "s").run_dir.name == "20240506-070809-11"
