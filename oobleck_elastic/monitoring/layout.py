"""A picture of a generation's layout: which worker runs which layers of which pipeline.

Rows are workers (grouped by pipeline, labelled `p<pipeline> n<node> w<rank>`), columns are
layers; a worker's stage is a bar in its pipeline's colour. Rendered to PNG with the standard
library only (zlib), so TensorBoard and the run directory get the same picture without an
imaging dependency.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

__all__ = ["render_layout", "encode_png"]

# 3x5 glyphs: five rows of three pixels, '#' = ink.
_GLYPHS = {k: v.split("|") for k, v in {
    "0": "###|#.#|#.#|#.#|###", "1": ".#.|##.|.#.|.#.|###", "2": "###|..#|###|#..|###",
    "3": "###|..#|###|..#|###", "4": "#.#|#.#|###|..#|..#", "5": "###|#..|###|..#|###",
    "6": "###|#..|###|#.#|###", "7": "###|..#|..#|..#|..#", "8": "###|#.#|###|#.#|###",
    "9": "###|#.#|###|..#|###", "p": "###|#.#|###|#..|#..", "n": "...|##.|#.#|#.#|#.#",
    "w": "...|#.#|#.#|###|###", "g": "###|#..|#.#|#.#|###", "e": "###|#..|###|#..|###",
    "l": "#..|#..|#..|#..|###", "a": ".#.|#.#|###|#.#|#.#", "y": "#.#|#.#|.#.|.#.|.#.",
    "r": "...|##.|#.#|#..|#..", "s": "###|#..|###|..#|###", "o": "...|###|#.#|#.#|###",
    "i": ".#.|...|.#.|.#.|.#.", "t": "###|.#.|.#.|.#.|.#.", "d": "..#|..#|###|#.#|###",
    "f": "###|#..|##.|#..|#..", "k": "#.#|#.#|##.|#.#|#.#", "m": "...|###|###|#.#|#.#",
    "u": "...|#.#|#.#|#.#|###", "c": "...|###|#..|#..|###", "b": "#..|#..|###|#.#|###",
    "h": "#..|#..|###|#.#|#.#", "v": "...|#.#|#.#|#.#|.#.", "x": "...|#.#|.#.|#.#|#.#",
    ":": "...|.#.|...|.#.|...", "-": "...|...|###|...|...", " ": "...|...|...|...|...",
    ",": "...|...|...|.#.|#..", "(": ".#.|#..|#..|#..|.#.", ")": ".#.|..#|..#|..#|.#.",
}.items()}
_PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
            (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]


def encode_png(pixels: Sequence[Sequence[tuple[int, int, int]]]) -> bytes:
    """RGB rows -> PNG bytes."""
    height, width = len(pixels), len(pixels[0])
    raw = b"".join(b"\x00" + bytes(c for px in row for c in px) for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


class _Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.px = [[(255, 255, 255)] * width for _ in range(height)]

    def rect(self, x: int, y: int, w: int, h: int, color: tuple[int, int, int]) -> None:
        for yy in range(max(y, 0), min(y + h, len(self.px))):
            row = self.px[yy]
            for xx in range(max(x, 0), min(x + w, len(row))):
                row[xx] = color

    def text(self, x: int, y: int, s: str, scale: int = 2, color=(0, 0, 0)) -> None:
        for ch in s.lower():
            for r, row in enumerate(_GLYPHS.get(ch, _GLYPHS[" "])):
                for c, pixel in enumerate(row):
                    if pixel == "#":
                        self.rect(x + c * scale, y + r * scale, scale, scale, color)
            x += 4 * scale


def render_layout(rows: Sequence[tuple[int, int, int, Sequence[int]]], num_layers: int,
                  title: str) -> bytes:
    """PNG of `rows` = (pipeline, node, local_rank, layers held) per worker."""
    cell, row_h, label_w, top = 12, 16, 150, 34
    width = label_w + num_layers * cell + 10
    height = top + len(rows) * row_h + 10
    canvas = _Canvas(width, height)
    canvas.text(6, 6, title)
    step = max(1, (num_layers + 9) // 10)
    for layer in range(0, num_layers, step):
        canvas.text(label_w + layer * cell, 20, str(layer), scale=1)
    for i, (pipeline, node, rank, layers) in enumerate(rows):
        y = top + i * row_h
        canvas.text(6, y + 2, f"p{pipeline} n{node} w{rank}")
        canvas.rect(label_w, y + row_h - 2, num_layers * cell, 1, (220, 220, 220))
        color = _PALETTE[pipeline % len(_PALETTE)]
        for layer in layers:
            canvas.rect(label_w + layer * cell, y + 1, cell - 1, row_h - 3, color)
    return encode_png(canvas.px)
