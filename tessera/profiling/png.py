"""The report's picture (picture.py) as a PNG of the scene's size, for terminals and issues: drawn with
matplotlib when it is installed (labels included), else rasterised here (zlib, no dependency): the
same rectangles, without the labels."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

from tessera.profiling.picture import Scene


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _rgb(colour: str) -> bytes:
    return bytes(int(colour[i:i + 2], 16) for i in (1, 3, 5))


def raster_png(picture: Scene) -> bytes:
    """An 8-bit RGB PNG of the scene's rectangles on white."""
    w, h = picture.width, picture.height
    rows = [bytearray(b"\xff" * (3 * w)) for _ in range(h)]
    for b in picture.boxes:
        x0, x1 = max(int(b.x), 0), min(int(b.x + max(b.w, 1)), w)
        y0, y1 = max(int(b.y), 0), min(int(b.y + max(b.h, 1)), h)
        if x1 <= x0 or y1 <= y0:
            continue
        line = _rgb(b.colour) * (x1 - x0)
        for y in range(y0, y1):
            rows[y][3 * x0:3 * x1] = line
    raw = b"".join(b"\x00" + bytes(r) for r in rows)  # filter type 0 on every row
    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 9)) + \
        _chunk(b"IEND", b"")


def _matplotlib_png(picture: Scene, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    dpi = 100
    fig = plt.figure(figsize=(picture.width / dpi, picture.height / dpi), dpi=dpi)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, picture.width)
    ax.set_ylim(picture.height, 0)
    ax.axis("off")
    for b in picture.boxes:
        ax.add_patch(plt.Rectangle((b.x, b.y), b.w, b.h, color=b.colour, linewidth=0))
    for t in picture.texts:
        ax.text(t.x, t.y, t.text, fontsize=8, va="baseline")
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return True


def write_png(picture: Scene, path: Path | str) -> None:
    """Write the picture to `path` (matplotlib's drawing if available, else `raster_png`)."""
    path = Path(path)
    if not _matplotlib_png(picture, path):
        path.write_bytes(raster_png(picture))
