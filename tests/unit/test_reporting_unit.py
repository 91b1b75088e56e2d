"""The metrics log reads back whole records only: a record torn by a killed writer is dropped,
not glued to the next one (the run report on a real store: tests/store/test_reporting.py)."""

from __future__ import annotations

import pytest

from oobleck_elastic.monitoring.metrics import JsonlSink, read_records


def test_metrics_log_reads_back_whole_records_only(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    sink = JsonlSink(path)
    sink.write({"step": 0, "loss": 1.5})
    sink.write({"event": "final", "step": 1})
    sink.close()
    assert read_records(path) == [{"step": 0, "loss": 1.5}, {"event": "final", "step": 1}]
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"step": 2, "lo')  # the writer killed mid-record
    assert [r["step"] for r in read_records(path)] == [0, 1]
    # the next rank 0 appends to the same log: the torn record goes, not glued to the new one
    sink = JsonlSink(path)
    sink.write({"step": 2, "loss": 1.25})
    sink.close()
    assert sink.dropped == len('{"step": 2, "lo')
    assert read_records(path) == [{"step": 0, "loss": 1.5}, {"event": "final", "step": 1},
                                  {"step": 2, "loss": 1.25}]
    with open(path, "w", encoding="utf-8") as f:
        f.write('{"step": 0, "lo')  # killed in its first record
    JsonlSink(path).close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    with open(path, "w", encoding="utf-8") as f:
        f.write('{"step": 0}\nnot json\n{"step": 1}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2 is not a JSON record"):
        read_records(path)
    assert read_records(str(tmp_path / "none.jsonl"), missing_ok=True) == []
    with pytest.raises(FileNotFoundError):
        read_records(str(tmp_path / "none.jsonl"))
