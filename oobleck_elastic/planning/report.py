"""Readable tables of plans, for the dry-run CLI, the launcher and TensorBoard's text tab."""

from __future__ import annotations

from collections.abc import Sequence

from oobleck_elastic.planning.instantiate import Instantiation
from oobleck_elastic.planning.reconfigure import ReconfigurationPlan
from oobleck_elastic.planning.templates import PipelineTemplate, TemplateSet

__all__ = ["table", "templates_table", "instantiation_table", "reconfiguration_text", "fmt_bytes"]


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(map(str, header))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _split(template: PipelineTemplate, limit: int = 6) -> str:
    parts = [f"{s.layers[0]}-{s.layers[1]}" for s in template.stages]
    if len(parts) > limit:
        parts = parts[:limit - 2] + ["..."] + parts[-1:]
    return ",".join(parts)


def templates_table(ts: TemplateSet) -> str:
    rows = [(t.nodes, t.num_stages, t.width, _split(t), t.microbatches, f"{t.iteration_ms:.1f}",
             fmt_bytes(max(s.memory_bytes for s in t.stages))) for t in ts.templates]
    text = table(["nodes", "stages", "width", "layers per stage", "M", "est. ms", "peak mem/worker"], rows)
    notes = [f"n0 = {ts.min_nodes}; templates for {ts.templates[0].nodes}..{ts.templates[-1].nodes} nodes"]
    if ts.templates[0].virtual_stages > 1:
        notes.append(f"interleaved: {ts.templates[0].virtual_stages} stages per worker; stage k runs on worker "
                     "k mod P of a P-worker pipeline")
    notes += [f"no template for {k}: {why}" for k, why in sorted(ts.infeasible.items())]
    if ts.uncovered:
        notes.append(f"WARNING: live node counts {list(ts.uncovered)} cannot be covered by "
                     f">= {ts.fault_tolerance + 1} pipelines")
    else:
        lo = (ts.fault_tolerance + 1) * ts.min_nodes
        notes.append(f"every live node count in [{lo}, {ts.max_nodes}] is covered by "
                     f">= {ts.fault_tolerance + 1} pipelines")
    return text + "\n" + "\n".join(notes)


def _nodes(nodes: Sequence[int], limit: int = 8) -> str:
    if len(nodes) > limit:
        return ",".join(map(str, nodes[:limit - 1])) + f",...({len(nodes)})"
    return ",".join(map(str, nodes))


def instantiation_table(inst: Instantiation, limit: int = 40) -> str:
    rows: list[tuple[object, ...]] = [
        (i, _nodes(p.nodes), p.template, p.microbatches, p.microbatches * inst.microbatch_size,
         f"{p.iteration_ms:.1f}") for i, p in enumerate(inst.pipelines)]
    if len(rows) > limit:
        rows = rows[:limit - 1] + [("...", f"{len(rows) - limit + 1} more", "", "", "", "")]
    text = table(["pipeline", "nodes", "template", "microbatches", "samples", "est. ms"], rows)
    return (text + f"\n{len(inst.pipelines)} pipelines on {len(inst.nodes)} nodes, global batch "
            f"{inst.global_batch_size}, estimated step {inst.iteration_ms:.1f} ms")


def reconfiguration_text(plan: ReconfigurationPlan, limit: int = 30) -> str:
    lines = [f"lost {list(plan.lost)}, joined {list(plan.joined)}"]
    lines += [f"  - {a}" for a in plan.actions]
    lines += [f"  WARNING: {w}" for w in plan.warnings]
    lines.append(instantiation_table(plan.instantiation))
    rows: list[tuple[object, ...]] = [
        (t.layer, f"{t.src.node}/{t.src.local_rank}", f"{t.dst.node}/{t.dst.local_rank}", fmt_bytes(t.bytes))
        for t in plan.transfers]
    if len(rows) > limit:
        rows = rows[:limit - 1] + [("...", f"{len(rows) - limit + 1} more", "", "")]
    lines.append(table(["layer", "src node/rank", "dst node/rank", "bytes"], rows) if rows
                 else "no layer state to move")
    senders: dict[object, int] = {}
    for t in plan.transfers:
        senders[t.src] = senders.get(t.src, 0) + t.bytes
    if senders:
        lines.append(f"{len(plan.transfers)} transfers, {fmt_bytes(plan.bytes_moved)} in all, "
                     f"{len(senders)} senders, largest sender {fmt_bytes(max(senders.values()))}")
    return "\n".join(lines)
