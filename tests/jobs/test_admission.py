"""Failures around a membership change, with real SIGKILLs: a member
lost while joiners are admitted does not cost the joiners their admission, a member that died
after the commit is left out of the admission, and a node lost while the first generation is
built does not end the run. Each ends with the weights of a failure-free run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from jobs import SCRIPT, assert_matches, job_args, records

LONG = ["--set", "train.steps=40"]  # as failure_free_40 (jobs.py)


def run_job(tmp_path, nodes: int, fault: str, launcher: tuple[str, ...] = (), sets: tuple[str, ...] = ()):
    env = {**os.environ, "OOBLECK_FAULT": fault}
    proc = subprocess.run([sys.executable, "-m", "oobleck_elastic.launch", f"--oobleck-local-nodes={nodes}",
                           "--nproc-per-node=1", f"--oobleck-log-dir={tmp_path / 'logs'}", *launcher, SCRIPT,
                           *job_args(tmp_path, "job"), *sets],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return records(tmp_path / "job/metrics.jsonl")


@pytest.mark.parametrize("phase", ["admit", "grow"])
def test_a_member_lost_as_a_joiner_is_admitted_leaves_the_joiner_in(tmp_path, failure_free_40, phase):
    # admit: node 1 dies once the record admitting node 4 has won (so the build fails: a failed
    # admission drops the joiner); grow: node 1 dies after the commit, before
    # the admission is proposed ("grow proposes a member that died during apply")
    log = run_job(tmp_path, 4, f"node=1,step=3,phase={phase}", ("--oobleck-add-node-at-step=3",), LONG)
    changes = [(r["lost"], r["joined"]) for r in log if r.get("event") == "recovery"]
    assert changes == [([1], [4])], changes
    steps = [r for r in log if "step" in r and "event" not in r]
    assert [r["step"] for r in steps] == list(range(40)), "no step lost or repeated"
    assert steps[-1]["nodes"] == 4
    assert_matches([r for r in log if r.get("event") == "final"][0], failure_free_40)


def test_a_node_lost_while_the_first_generation_is_built_does_not_end_the_run(tmp_path, failure_free):
    log = run_job(tmp_path, 4, "node=3,step=0,phase=build")
    recoveries = [r for r in log if r.get("event") == "recovery"]
    # node 3 is lost; on a loaded machine a survivor too slow to build within the collective
    # timeout may be left out as well: the run goes on all the same
    assert recoveries and 3 in recoveries[0]["lost"] and "started the run again" in recoveries[0]["actions"][0]
    steps = [r for r in log if "step" in r and "event" not in r]
    assert [r["step"] for r in steps] == list(range(6)) and steps[0]["nodes"] <= 3
    assert_matches([r for r in log if r.get("event") == "final"][0], failure_free)


def test_a_lone_survivor_waits_for_a_replacement_and_restores_the_checkpoint_with_it(tmp_path, failure_free):
    """Three of four nodes die at once and the smallest pipeline needs two: node 0 waits for the
    node started meanwhile (elastic.join_timeout_s) and restores the checkpoint with it, exactly
    (the chaos run found a single survivor ending the run with a planning error)."""
    kills = ";".join(f"node={n},step=3,phase=backward" for n in (1, 2, 3))
    kills += ";node=4,step=0,phase=join,action=slow,seconds=4"  # node 4 is ready after the kills
    log = run_job(tmp_path, 4, kills, ("--oobleck-add-node-at-step=3",),
                  ("--set", "checkpoint.interval=2", "--set", f"checkpoint.dir={tmp_path / 'ckpt'}"))
    recoveries = [r for r in log if r.get("event") == "recovery"]
    # the three reach step 3's backward at different moments: one or two recoveries
    assert sorted(n for r in recoveries for n in r["lost"]) == [1, 2, 3], recoveries
    assert (recoveries[-1]["joined"], recoveries[-1]["restored_from"]) == ([4], 2), recoveries
    assert any("only 1 node(s) left and the smallest pipeline needs 2" in f.read_text()
               for f in (tmp_path / "logs").glob("*.log"))
    steps = [r for r in log if "step" in r and "event" not in r]
    assert [r["step"] for r in steps][:3] == [0, 1, 2] and [r["step"] for r in steps][-4:] == [2, 3, 4, 5]
    assert steps[-1]["nodes"] == 2
    assert_matches([r for r in log if r.get("event") == "final"][0], failure_free)


def test_every_member_lost_while_nodes_wait_to_join_the_joiners_restore_the_checkpoint(tmp_path, failure_free):
    """Both members die in step 3 (one pipeline each; the second maybe after the first's
    recovery) while two replacements get ready: nobody is left to admit them, so the ready joiners propose
    the next generation themselves and restore the newest checkpoint (Note: [orphaned run]);
    they used to wait out elastic.join_timeout_s and the job ended."""
    kills = ";".join(f"node={n},step=3,phase=backward" for n in (0, 1))
    # started after step 0 (the launcher would stop at once if every node had died first), ready
    # seconds later, long after the kills
    kills += "".join(f";node={n},step=0,phase=join,action=slow,seconds=4" for n in (2, 3))
    log = run_job(tmp_path, 2, kills, ("--oobleck-add-node-at-step=1", "--oobleck-add-node-at-step=1"),
                  ("--set", "planner.memory_per_worker=1GB", "--set", "checkpoint.interval=2",
                   "--set", "checkpoint.background=false",  # the checkpoint of step 2 is whole before step 3
                   "--set", f"checkpoint.dir={tmp_path / 'ckpt'}"))
    recoveries = [r for r in log if r.get("event") == "recovery"]
    orphaned = [r for r in recoveries if "was lost" in r["cause"]]
    assert len(orphaned) == 1 and orphaned[0]["restored_from"] == 2, recoveries
    assert orphaned[0]["cause"].startswith("every member of generation"), orphaned
    assert set(orphaned[0]["joined"]) <= {2, 3} and orphaned[0]["joined"] and 1 in orphaned[0]["lost"], orphaned
    assert sorted(n for r in recoveries for n in r["lost"]) == [0, 1], recoveries
    steps = [r for r in log if "step" in r and "event" not in r]
    assert [r["step"] for r in steps][-4:] == [2, 3, 4, 5]
    assert_matches([r for r in log if r.get("event") == "final"][0], failure_free)
