"""A terminal screen captured with its colours, drawn as a PNG: how docs/watch.png was made.

    tmux capture-pane -e -p -t SESSION > screen.txt
    python docs/terminal_png.py screen.txt docs/watch.png

Reads the SGR escapes tmux writes (reset, bold, dim, the 8 and 16 colours, default colours); other escapes
are dropped. Draws with matplotlib's DejaVu Sans Mono on a dark background, and stores the PNG with a palette.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

SGR = re.compile(r"\x1b\[([0-9;]*)m")
OTHER_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-ln-z]|\x1b[()][0-9A-Za-z]")
PALETTE = ["#2e3436", "#ef5350", "#8ae234", "#fce94f", "#729fcf", "#ad7fa8", "#34e2e2", "#d3d7cf"]
BRIGHT = ["#555753", "#ff6e6e", "#b5f56b", "#fffb8a", "#9fc5f8", "#d7a6d2", "#8cf0f0", "#eeeeec"]
FOREGROUND, BACKGROUND = "#d3d7cf", "#1e1e1e"
FONT_SIZE = 11.0
ADVANCE = 0.602  # DejaVu Sans Mono's advance, in ems
LINE = 1.35  # line height, in ems


Style = tuple[str, bool, bool]  # colour, bold, dim
PLAIN: Style = (FOREGROUND, False, False)


def restyled(style: Style, codes: list[int]) -> Style:
    """``style`` after an SGR escape's codes."""
    colour, bold, dim = style
    for code in codes or [0]:
        if code == 0:
            colour, bold, dim = PLAIN
        elif code == 1:
            bold = True
        elif code == 2:
            dim = True
        elif code == 22:
            bold = dim = False
        elif 30 <= code <= 37 or 90 <= code <= 97:
            colour = PALETTE[code - 30] if code < 90 else BRIGHT[code - 90]
        elif code == 39:
            colour = FOREGROUND
    return colour, bold, dim


def spans(line: str, style: Style) -> tuple[list[tuple[int, str, Style]], Style]:
    """(column, text, style) of each run of one style in a line of the capture, and the style at its end (tmux
    writes an escape only where the style changes, also across lines)."""
    column, found = 0, []
    for index, part in enumerate(SGR.split(OTHER_ESCAPES.sub("", line))):
        if index % 2:  # the codes of an escape
            style = restyled(style, [int(code) for code in part.split(";") if code])
        elif part:
            found.append((column, part, style))
            column += len(part)
    return found, style


def draw(screen: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    lines = screen.rstrip("\n").split("\n")
    while lines and not SGR.sub("", lines[-1]).strip():
        lines.pop()
    columns = max(len(SGR.sub("", OTHER_ESCAPES.sub("", line)).rstrip()) for line in lines) + 2
    em = FONT_SIZE / 72  # inches
    figure = plt.figure(figsize=(columns * ADVANCE * em, (len(lines) + 1) * LINE * em), dpi=110,
                        facecolor=BACKGROUND)
    axes = figure.add_axes((0, 0, 1, 1))
    axes.set_xlim(-1, columns - 1)
    axes.set_ylim(len(lines) + 0.5, -0.5)
    axes.axis("off")
    style = PLAIN
    for row, line in enumerate(lines):
        found, style = spans(line, style)
        for column, text, (colour, bold, dim) in found:
            axes.text(column, row + 0.35, text, color=colour, alpha=0.6 if dim else 1.0, family="DejaVu Sans Mono",
                      fontsize=FONT_SIZE, fontweight="bold" if bold else "normal", va="baseline")
    figure.savefig(path, facecolor=BACKGROUND)
    plt.close(figure)
    Image.open(path).convert("RGB").quantize(colors=32).save(path, optimize=True)
    return path


if __name__ == "__main__":
    print(draw(Path(sys.argv[1]).read_text(), Path(sys.argv[2])))
