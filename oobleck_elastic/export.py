"""`python -m oobleck_elastic.export CHECKPOINT_DIR OUT_DIR`: a run's latest checkpoint in the
model's own format.

The newest is the one written last (a directory several runs wrote to exports the latest
run's, not the highest step). For a Hugging Face model, OUT_DIR is a directory that
`AutoModelForCausalLM.from_pretrained` loads (config.json + model.safetensors, tied weights
stored as transformers stores them); for any other model, OUT_DIR/model.safetensors holds the
full state_dict under the model's own parameter names (runtime.model Note: [parameter names]).
"""

from __future__ import annotations

import argparse
import os
import sys

from oobleck_elastic.errors import OobleckError
from oobleck_elastic.runtime.checkpoint import checkpoints, load_model_state

__all__ = ["export_checkpoint", "main"]


def export_checkpoint(root: str, out_dir: str) -> tuple[int, str]:
    """Writes the newest complete checkpoint under `root` to `out_dir`; returns (step, format)."""
    if not os.path.isdir(root):
        raise OobleckError(f"{root!r} is not a directory; pass the run's checkpoint.dir")
    found = checkpoints(root)
    if not found:
        raise OobleckError(f"{root!r} holds no complete checkpoint (a run writes one after its last step "
                           "and every checkpoint.interval steps)")
    step, manifest = found[0]  # the newest: the latest start's highest step (Note: [newest checkpoint])
    state = load_model_state(root, step, manifest["layers"])
    model = manifest.get("model") or {"format": "safetensors"}
    os.makedirs(out_dir, exist_ok=True)
    if model.get("format") == "hf":
        from oobleck_elastic.models.hf import export_hf

        export_hf(state, model, out_dir)
    else:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, "model.safetensors"))
    return step, model.get("format", "safetensors")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m oobleck_elastic.export", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint_dir", help="the run's checkpoint.dir")
    p.add_argument("out_dir", help="where to write the model")
    args = p.parse_args(argv)
    try:
        step, fmt = export_checkpoint(args.checkpoint_dir, args.out_dir)
    except (OobleckError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"exported the checkpoint of step {step} to {args.out_dir} ({fmt})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
