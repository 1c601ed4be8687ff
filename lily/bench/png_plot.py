"""A small self-contained line-plot renderer that writes PNG (zlib + a 5x7 bitmap font): the bench plot
must be drawable on a bare GPU machine with no matplotlib and no network."""

from __future__ import annotations

import math
import struct
import zlib

# 5x7 glyphs, rows top to bottom, 5 bits each (MSB = leftmost pixel). Lowercase draws as uppercase.
_GLYPHS = {
    "A": "01110 10001 10001 11111 10001 10001 10001", "B": "11110 10001 10001 11110 10001 10001 11110",
    "C": "01110 10001 10000 10000 10000 10001 01110", "D": "11110 10001 10001 10001 10001 10001 11110",
    "E": "11111 10000 10000 11110 10000 10000 11111", "F": "11111 10000 10000 11110 10000 10000 10000",
    "G": "01110 10001 10000 10111 10001 10001 01111", "H": "10001 10001 10001 11111 10001 10001 10001",
    "I": "01110 00100 00100 00100 00100 00100 01110", "J": "00111 00010 00010 00010 00010 10010 01100",
    "K": "10001 10010 10100 11000 10100 10010 10001", "L": "10000 10000 10000 10000 10000 10000 11111",
    "M": "10001 11011 10101 10101 10001 10001 10001", "N": "10001 10001 11001 10101 10011 10001 10001",
    "O": "01110 10001 10001 10001 10001 10001 01110", "P": "11110 10001 10001 11110 10000 10000 10000",
    "Q": "01110 10001 10001 10001 10101 10010 01101", "R": "11110 10001 10001 11110 10100 10010 10001",
    "S": "01111 10000 10000 01110 00001 00001 11110", "T": "11111 00100 00100 00100 00100 00100 00100",
    "U": "10001 10001 10001 10001 10001 10001 01110", "V": "10001 10001 10001 10001 10001 01010 00100",
    "W": "10001 10001 10001 10101 10101 10101 01010", "X": "10001 10001 01010 00100 01010 10001 10001",
    "Y": "10001 10001 01010 00100 00100 00100 00100", "Z": "11111 00001 00010 00100 01000 10000 11111",
    "0": "01110 10001 10011 10101 11001 10001 01110", "1": "00100 01100 00100 00100 00100 00100 01110",
    "2": "01110 10001 00001 00010 00100 01000 11111", "3": "11111 00010 00100 00010 00001 10001 01110",
    "4": "00010 00110 01010 10010 11111 00010 00010", "5": "11111 10000 11110 00001 00001 10001 01110",
    "6": "00110 01000 10000 11110 10001 10001 01110", "7": "11111 00001 00010 00100 01000 01000 01000",
    "8": "01110 10001 10001 01110 10001 10001 01110", "9": "01110 10001 10001 01111 00001 00010 01100",
    "-": "00000 00000 00000 11111 00000 00000 00000", ".": "00000 00000 00000 00000 00000 01100 01100",
    "/": "00000 00001 00010 00100 01000 10000 00000", ",": "00000 00000 00000 00000 01100 00100 01000",
    "%": "11000 11001 00010 00100 01000 10011 00011", "(": "00010 00100 01000 01000 01000 00100 00010",
    ")": "01000 00100 00010 00010 00010 00100 01000", ":": "00000 01100 01100 00000 01100 01100 00000",
    "_": "00000 00000 00000 00000 00000 00000 11111", "+": "00000 00100 00100 11111 00100 00100 00000",
    "=": "00000 00000 11111 00000 11111 00000 00000", " ": "00000 00000 00000 00000 00000 00000 00000",
    "?": "01110 10001 00001 00010 00100 00000 00100",
}

WHITE, BLACK, GREY, LIGHT = (255, 255, 255), (0, 0, 0), (110, 110, 110), (225, 225, 225)
PALETTE = [(214, 39, 40), (31, 119, 180), (44, 160, 44), (148, 103, 189), (255, 127, 14), (140, 86, 75)]


class Canvas:
    def __init__(self, width: int, height: int, background=WHITE):
        self.w, self.h = width, height
        self.px = bytearray(bytes(background) * (width * height))

    def dot(self, x: int, y: int, color) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = 3 * (y * self.w + x)
            self.px[i:i + 3] = bytes(color)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color, fill: bool = True) -> None:
        for y in range(min(y0, y1), max(y0, y1) + 1):
            for x in range(min(x0, x1), max(x0, x1) + 1):
                if fill or y in (y0, y1) or x in (x0, x1):
                    self.dot(x, y, color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color, width: int = 1) -> None:
        n = max(abs(x1 - x0), abs(y1 - y0), 1)
        for s in range(n + 1):
            x, y = round(x0 + (x1 - x0) * s / n), round(y0 + (y1 - y0) * s / n)
            for dy in range(width):
                for dx in range(width):
                    self.dot(x + dx - width // 2, y + dy - width // 2, color)

    def text(self, x: int, y: int, s: str, color=BLACK, scale: int = 2, anchor: str = "left") -> None:
        """Draw s with its top at y; anchor left|right|center on x."""
        wpx = text_width(s, scale)
        x = x - wpx if anchor == "right" else x - wpx // 2 if anchor == "center" else x
        for ch in s:
            rows = _GLYPHS.get(ch.upper(), _GLYPHS["?"]).split()
            for r, bits in enumerate(rows):
                for c, b in enumerate(bits):
                    if b == "1":
                        self.rect(x + c * scale, y + r * scale, x + c * scale + scale - 1, y + r * scale + scale - 1, color)
            x += 6 * scale

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[3 * y * self.w: 3 * (y + 1) * self.w]) for y in range(self.h))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def text_width(s: str, scale: int = 2) -> int:
    return 6 * scale * len(s) - scale


def context_label(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _si(v: float) -> str:
    return f"{v / 1e6:g}M" if v >= 1e6 else f"{v / 1e3:g}K" if v >= 1e3 else f"{v:g}"


def panel(cv: Canvas, box: tuple[int, int, int, int], title: str, xs: list[int],
          series: list[tuple[str, tuple, list[tuple[int, float, bool]]]]) -> None:
    """One log-log panel: x = context (log2), y = tok/s (log10). series: (name, colour, [(x, y, refused)]);
    refused points are drawn hollow."""
    x0, y0, x1, y1 = box
    cv.text((x0 + x1) // 2, y0 - 30, title, anchor="center")
    ys = [y for _, _, pts in series for _, y, _ in pts if y and y > 0]
    if not xs or not ys:
        cv.text((x0 + x1) // 2, (y0 + y1) // 2, "no data", GREY, anchor="center")
        return
    lo, hi = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))
    hi = max(hi, lo + 1)
    lx0, lx1 = math.log2(min(xs)), math.log2(max(xs))
    span = max(lx1 - lx0, 1.0)

    def X(v):
        return round(x0 + 20 + (math.log2(v) - lx0) / span * (x1 - x0 - 40))

    def Y(v):
        return round(y1 - (math.log10(v) - lo) / (hi - lo) * (y1 - y0))

    for e in range(lo, hi + 1):                        # decades: grid line and label
        yy = Y(10 ** e)
        cv.line(x0, yy, x1, yy, LIGHT)
        cv.text(x0 - 8, yy - 7, _si(10 ** e), GREY, anchor="right")
    for v in xs:
        cv.line(X(v), y0, X(v), y1, LIGHT)
        cv.text(X(v), y1 + 8, context_label(v), GREY, scale=1 if len(xs) > 6 else 2, anchor="center")
    cv.rect(x0, y0, x1, y1, BLACK, fill=False)
    cv.text((x0 + x1) // 2, y1 + 26, "context (tokens)", anchor="center")
    for _, colour, pts in series:
        pts = sorted((x, y, r) for x, y, r in pts if y and y > 0)
        for (a, ya, _), (b, yb, _) in zip(pts, pts[1:]):
            cv.line(X(a), Y(ya), X(b), Y(yb), colour, width=2)
        for x, y, refused in pts:
            cv.rect(X(x) - 4, Y(y) - 4, X(x) + 4, Y(y) + 4, colour, fill=not refused)


def plot_throughput(path, engines: dict[str, list[dict]], title: str) -> None:
    """engines: name -> rows (contract.Row as JSON). Two panels, prefill and decode tok/s vs context."""
    cv = Canvas(1280, 600)
    cv.text(640, 12, title, anchor="center")
    xs = sorted({r["context"] for rows in engines.values() for r in rows})
    for i, (key, label) in enumerate((("prefill_tok_s", "prefill tok/s"), ("decode_tok_s", "decode tok/s"))):
        series = [(name, PALETTE[j % len(PALETTE)],
                   [(r["context"], r.get(key), bool(r.get("refused"))) for r in rows])
                  for j, (name, rows) in enumerate(engines.items())]
        panel(cv, (110 + i * 640, 80, 600 + i * 640, 500), label, xs, series)
    x = 110
    for j, name in enumerate(engines):                 # legend along the bottom
        colour = PALETTE[j % len(PALETTE)]
        cv.rect(x, 563, x + 24, 569, colour)
        cv.text(x + 32, 559, name)
        x += 32 + text_width(name) + 40
    cv.text(1260, 559, "hollow = refused row", GREY, anchor="right")
    with open(path, "wb") as f:
        f.write(cv.png())
