"""What checkpoints cost a training step: the GPT example (width 256, 8 blocks, 6.6 M
parameters: 79 MB of parameters and AdamW state per checkpoint) trained alone for --steps
steps with no checkpoints, with `checkpoint.interval: 10` written synchronously
(`checkpoint.background: false`, the step waits for the disk), and with the same interval
written in the background (the default: the step copies its layers' state to host memory, a
thread writes it).

    python benchmarks/checkpoint.py [--steps 40] [--rounds 2]

Every run is the one-process job (`examples/gpt/train.py`), one torch thread, in the same
command; rounds rotate the order so the machine's noise hits all three. A run's step time is
the wall time between its second and last step records (so it includes the checkpoints of
steps 10, 20, ...; the final checkpoint after the last step is not counted); printed: the
median over rounds of each variant's ms/step and of each round's ratio to "none" (goal for
background: overhead < 5%).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {
    "none": ["checkpoint.interval=0"],
    "sync": ["checkpoint.interval=10", "checkpoint.background=false"],
    "background": ["checkpoint.interval=10", "checkpoint.background=true"],
}
MODEL = ["model.d_model=256", "model.n_layers=8", "model.n_heads=8", "model.seq_len=32", "model.vocab_size=512",
         "train.global_batch_size=16", "train.microbatch_size=4", "planner.memory_per_worker=4GB",
         "fault_tolerance=0"]


def run(variant: str, steps: int, work: str) -> float:
    """Seconds per step of one run (see the module docstring)."""
    out = os.path.join(work, variant)
    sets = [*MODEL, f"train.steps={steps}", *VARIANTS[variant], f"checkpoint.dir={out}/checkpoints",
            "checkpoint.resume=never", f"planner.profile_dir={work}/profiles",
            f"monitoring.metrics_path={out}/metrics.jsonl", f"monitoring.tensorboard_dir={out}/tb"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples/gpt/train.py"),
                           *(x for s in sets for x in ("--set", s))], env=env, capture_output=True, text=True,
                          timeout=1800)
    if proc.returncode:
        raise SystemExit(f"the {variant} run failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        times = [r["time"] for r in map(json.loads, f) if "step" in r and "event" not in r]
    os.remove(os.path.join(out, "metrics.jsonl"))
    return (times[-1] - times[1]) / (len(times) - 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    names = list(VARIANTS)
    per_step: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as work:
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            seconds = {n: run(n, args.steps, work) for n in order}
            for n in names:
                per_step[n].append(seconds[n])
                ratios[n].append(seconds[n] / seconds["none"])
            print(f"round {r + 1}: " + "  ".join(f"{n} {seconds[n] * 1e3:.1f} ms/step" for n in order), flush=True)
    print(f"\n{'variant':<12}{'ms/step':>10}{'vs none':>10}  (medians over {args.rounds} rounds, "
          f"{args.steps} steps, a checkpoint every 10)")
    for n in names:
        print(f"{n:<12}{statistics.median(per_step[n]) * 1e3:>10.1f}{statistics.median(ratios[n]):>10.3f}"
              f"   range {min(ratios[n]):.3f}-{max(ratios[n]):.3f}")


if __name__ == "__main__":
    main()
