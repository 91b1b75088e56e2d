"""The dry-run CLI: tables, JSON keys, reconfiguration, evaluation and clean errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from oobleck_elastic.plan import main

BASE = ["--synthetic", "gpt:24", "--nnodes", "8", "--nproc-per-node", "1", "--fault-tolerance", "1",
        "--global-batch", "256", "--microbatch", "4", "--memory-per-worker", "36GiB"]


def run_json(capsys, *extra):
    assert main([*BASE, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_has_documented_keys(capsys):
    out = run_json(capsys, "--fail", "0", "--join", "1")
    t = out["templates"][0]
    assert out["coverage"]["min_nodes"] == 4 and "uncovered" in out["coverage"]
    assert t["nodes"] == 4 and t["iteration_ms"] > 0
    assert t["stages"][0]["layers"][0] == 0 and t["stages"][-1]["layers"][1] == 24
    assert {s["node"] for s in t["stages"]} == {0, 1, 2, 3}
    inst = out["instantiation"]
    assert [p["nodes"] for p in inst["pipelines"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert sum(p["microbatches"] for p in inst["pipelines"]) == 64
    assert inst["iteration_ms"] > 0
    new = out["reconfiguration"]["instantiation"]
    assert sorted(n for p in new["pipelines"] for n in p["nodes"]) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert out["transfers"] and set(out["transfers"][0]) >= {"layer", "src", "dst"}
    assert all(tr["dst"]["node"] == 8 for tr in out["transfers"])


def test_tables_and_evaluate(capsys):
    assert main([*BASE, "--fail", "5", "--evaluate", "0-6,6-12,12-18,18-24"]) == 0
    text = capsys.readouterr().out
    assert "Pipeline templates" in text and "Instantiation" in text and "Reconfiguration" in text
    assert "given   0-6,6-12,12-18,18-24" in text and "optimal" in text


def test_evaluate_json_compares_with_the_optimum(capsys):
    out = run_json(capsys, "--evaluate", "0-6,6-12,12-18,18-24")
    ev = out["evaluation"]
    assert ev["nodes"] == 4
    assert not ev["fits_memory"] and ev["stages_over_memory"] == [0]
    roomy = run_json(capsys, "--memory-per-worker", "80GiB", "--evaluate", "0-6,6-12,12-18,18-24")["evaluation"]
    assert roomy["fits_memory"]
    assert roomy["optimal_iteration_ms"] <= roomy["iteration_ms"]
    assert roomy["optimal_stages"] != [[0, 6], [6, 12], [12, 18], [18, 24]]


@pytest.mark.parametrize("extra, message", [
    (["--evaluate", "0-5,6-24"], "contiguous"),
    (["--evaluate", "0-5,5-20"], "ends at 20 but the model has 24 layers"),
    (["--fail", "42"], "lost node(s) [42] are not in the current instantiation"),
    (["--fail", "0,4"], "have no surviving replica"),
    (["--wide", "--virtual-stages", "2"], "--wide and --virtual-stages > 1 cannot be combined"),
    (["--virtual-stages", "0"], "--virtual-stages must be >= 1, got 0"),
])
def test_bad_input_exits_2_with_message(capsys, extra, message):
    assert main([*BASE, *extra]) == 2
    assert message in capsys.readouterr().err


def test_module_entry_point_without_traceback():
    proc = subprocess.run([sys.executable, "-m", "oobleck_elastic.plan", "--synthetic", "gpt:24",
                           "--nnodes", "4", "--global-batch", "30", "--microbatch", "4"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--global-batch (30) must be a multiple of --microbatch (4)" in proc.stderr
    assert "Traceback" not in proc.stderr
