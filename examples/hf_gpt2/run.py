"""The Hugging Face path as a user walks it, one line per stage:

    python -m examples.hf_gpt2.run [--workdir runs/hf_gpt2] [--steps 60] [--no-fault]

1. writes a small corpus from a toy grammar, trains a word-level tokenizer on it, saves a tiny
   random GPT-2 (tied embeddings) with save_pretrained and tokenizes the corpus with
   `python -m oobleck_elastic.data.prepare` (each skipped when its output exists in workdir);
2. trains the model with `python -m oobleck_elastic.launch ... -m oobleck_elastic.train` on 4
   local nodes, node 1 SIGKILLed mid-backward a third of the way in (unless --no-fault);
3. exports the last checkpoint with `python -m oobleck_elastic.export`, loads it with
   `AutoModelForCausalLM.from_pretrained` and continues a prompt greedily.

Every step runs the package's real command line; nothing is downloaded (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = Path(__file__).resolve().with_name("config.yaml")
STAGES = 7

# The toy grammar: each animal has its own verb, so a model that learnt the corpus continues
# "the quick fox" with "watches"; the other slots are uniform choices.
_ADJECTIVES = ("small", "big", "quick", "lazy", "brown", "old")
_VERBS = {"cat": "chases", "dog": "follows", "fox": "watches", "bird": "sees", "horse": "carries",
          "mouse": "fears"}
_PREPOSITIONS = ("in", "near", "by")
_PLACES = ("garden", "river", "forest", "barn", "field")
PROMPT = "the quick fox"


def _stage(k: int, name: str, text: str) -> None:
    print(f"[{k}/{STAGES}] {name}: {text}", flush=True)


def _run(cmd: list[str], *, capture: bool = True, env: dict[str, str] | None = None) -> str:
    """Runs one of the package's command lines from the repository root; stops the example with
    the command's own error output if it fails."""
    proc = subprocess.run(cmd, cwd=ROOT, env=env or os.environ.copy(), text=True,
                          capture_output=capture)
    if proc.returncode != 0:
        if capture:
            sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"failed (exit code {proc.returncode}): {' '.join(cmd)}")
    return proc.stdout if capture else ""


def write_corpus(path: Path, sentences: int = 600, seed: int = 0) -> str:
    """`sentences` lines of the toy grammar, the same every time."""
    rng = random.Random(seed)
    animals = sorted(_VERBS)
    lines = []
    for _ in range(sentences):
        subject, obj = rng.choice(animals), rng.choice(animals)
        lines.append(f"the {rng.choice(_ADJECTIVES)} {subject} {_VERBS[subject]} the {obj} "
                     f"{rng.choice(_PREPOSITIONS)} the {rng.choice(_PLACES)} .")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return f"wrote {sentences} sentences ({sum(len(s.split()) for s in lines)} words) to {path}"


def build_tokenizer(directory: Path, corpus: Path) -> str:
    """A word-level tokenizer (one id per corpus word, plus <unk> and <eos>), saved so that
    `AutoTokenizer.from_pretrained(directory)` loads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    # WordPiece's decoder with no "##" pieces joins words with spaces, which is all we need.
    backend.decoder = decoders.WordPiece()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"])
    backend.train_from_iterator(corpus.read_text(encoding="utf-8").splitlines(), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                        eos_token="<eos>")
    tokenizer.save_pretrained(directory)
    return f"vocabulary of {len(tokenizer)} (the corpus's words, <unk>, <eos>), saved to {directory}"


def build_model(directory: Path, tokenizer_dir: Path) -> str:
    """A tiny random GPT-2 (4 blocks of width 64, tied embeddings, no dropout), saved with
    save_pretrained."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    eos = tokenizer.eos_token_id
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=64, n_layer=4, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=eos,
                        eos_token_id=eos)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    model.save_pretrained(directory)
    params = sum(p.numel() for p in model.parameters())
    return f"GPT-2, {params:,} parameters (vocab {config.vocab_size}), saved to {directory}"


def prepare_tokens(output: Path, tokenizer_dir: Path, corpus: Path) -> str:
    out = _run([sys.executable, "-m", "oobleck_elastic.data.prepare",
                "--tokenizer", str(tokenizer_dir), "--output", str(output), str(corpus)])
    return out.splitlines()[0]


def _once(k: int, name: str, path: Path, make: Callable[[], str]) -> None:
    """Stage k, skipped when `path` exists (a previous run made it)."""
    if path.exists():
        _stage(k, name, f"{path} exists, skipped")
        return
    _stage(k, name, make())


def _train_command(run_dir: Path, work: Path, steps: int) -> list[str]:
    """The launcher's command line: the example's config, with this run's paths set."""
    sets = {"model.hf": work / "model", "data.tokens": work / "tokens.bin", "train.steps": steps,
            "planner.profile_dir": work / "profiles", "checkpoint.dir": run_dir / "checkpoints",
            "monitoring.metrics_path": run_dir / "metrics.jsonl",
            "monitoring.tensorboard_dir": run_dir / "tensorboard"}
    return [sys.executable, "-m", "oobleck_elastic.launch", "--oobleck-local-nodes", "4",
            "--nproc-per-node", "1", "--oobleck-log-dir", str(run_dir / "logs"),
            "-m", "oobleck_elastic.train", "--config", str(CONFIG),
            *(arg for key, value in sets.items() for arg in ("--set", f"{key}={value}"))]


def train(run_dir: Path, work: Path, steps: int, fault: bool) -> str:
    """The 4-node job, its launcher's lines shown as they come; returns the loss summary."""
    fault_step = steps // 3  # 0-based, as OOBLECK_FAULT counts; the launcher prints it 1-based
    fault = fault and fault_step >= 1  # a one- or two-step run has no middle to fail in
    kill = f"node=1,step={fault_step},phase=backward" if fault else ""
    env = {**os.environ, "OOBLECK_FAULT": kill}
    what = f"node 1 SIGKILLed in step {fault_step + 1}'s backward" if fault else "no failure"
    _stage(5, "train", f"{steps} steps on 4 local nodes, {what}")
    _run(_train_command(run_dir, work, steps), capture=False, env=env)
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    losses = [r["loss"] for r in records if "step" in r and "event" not in r]
    return f"loss {losses[0]:.3f} at step 1 -> {losses[-1]:.3f} at step {len(losses)}"


def generate(model_dir: Path, tokenizer_dir: Path, prompt: str, new_tokens: int = 12) -> str:
    """Greedy continuation of `prompt` by the exported model, loaded the way any HF user would."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    inputs = tokenizer(prompt, return_tensors="pt", return_token_type_ids=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
    return f"{prompt!r} -> {tokenizer.decode(out[0], skip_special_tokens=True)!r}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.hf_gpt2.run",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="runs/hf_gpt2", help="where the corpus, model and run go")
    p.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    p.add_argument("--no-fault", action="store_true", help="train without killing a node")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    os.environ["HF_HUB_OFFLINE"] = "1"  # inherited by every command below
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # save_pretrained's bar splits lines
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    corpus, tok_dir, model_dir = work / "corpus.txt", work / "tokenizer", work / "model"
    tokens = work / "tokens.bin"
    _once(1, "corpus", corpus, lambda: write_corpus(corpus))
    _once(2, "tokenizer", tok_dir, lambda: build_tokenizer(tok_dir, corpus))
    _once(3, "model", model_dir, lambda: build_model(model_dir, tok_dir))
    _once(4, "tokens", tokens, lambda: prepare_tokens(tokens, tok_dir, corpus))
    # A run starts clean: the metrics log appends, and export takes the newest checkpoint,
    # which an earlier, longer run would have left behind.
    run_dir = work / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    _stage(5, "trained", train(run_dir, work, args.steps, fault=not args.no_fault))
    exported = run_dir / "exported"
    out = _run([sys.executable, "-m", "oobleck_elastic.export", str(run_dir / "checkpoints"),
                str(exported)])
    _stage(6, "export", out.strip())
    _stage(7, "generate", generate(exported, tok_dir, PROMPT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
