"""A minimal VT100 screen for tests that read what a terminal would show: the cursor moves, line erases, carriage
returns and autowrap that tqdm and rich use; colours and modes are ignored. Every row written stays (scrollback)."""

import re

_SEQ = re.compile(r"\x1b\[([?0-9;]*)([A-Za-z])|\x1b[()][A-Za-z0-9]|\x1b[=>]|\r|\n|\x08|[^\x1b\r\n\x08]+")


class Screen:
    """Feed it a terminal's output (``feed``, in pieces or at once); ``lines()`` is the screen, one string a row."""

    def __init__(self, width: int = 120):
        self.width, self.rows, self.r, self.c = width, [[]], 0, 0

    def _row(self):
        while len(self.rows) <= self.r:
            self.rows.append([])
        return self.rows[self.r]

    def feed(self, text: str) -> None:
        """Interpret ``text``: CSI A/B/C/D/G cursor moves, K erase in line, CR, LF, BS; other escapes ignored."""
        for m in _SEQ.finditer(text):
            tok = m.group(0)
            if tok == "\r":
                self.c = 0
            elif tok == "\n":  # a terminal's output mapping (onlcr) makes every LF a CR LF
                self.r, self.c = self.r + 1, 0
                self._row()
            elif tok == "\x08":
                self.c = max(0, self.c - 1)
            elif m.group(2):
                n = int((m.group(1) or "1").lstrip("?").split(";")[0] or 1)
                k = m.group(2)
                if k == "A":
                    self.r = max(0, self.r - n)
                elif k == "B":
                    self.r += n
                elif k == "C":
                    self.c += n
                elif k == "D":
                    self.c = max(0, self.c - n)
                elif k == "G":
                    self.c = n - 1
                elif k == "K":
                    mode = int(m.group(1) or 0)
                    row = self._row()
                    if mode == 2:
                        row.clear()
                    elif mode == 0:
                        del row[self.c :]
            elif tok.startswith("\x1b"):
                pass
            else:
                for ch in tok:
                    if self.c >= self.width:
                        self.r, self.c = self.r + 1, 0
                    row = self._row()
                    while len(row) < self.c:
                        row.append(" ")
                    if self.c < len(row):
                        row[self.c] = ch
                    else:
                        row.append(ch)
                    self.c += 1

    def lines(self) -> list[str]:
        """Every row so far, trailing spaces stripped."""
        return ["".join(r).rstrip() for r in self.rows]
