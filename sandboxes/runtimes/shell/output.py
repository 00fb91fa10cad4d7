"""What one shell command printed: read in chunks until its status arrives, kept as head and tail
when it grows past what could be shown, and cut in the middle for the agent."""
from __future__ import annotations


def cut_middle(text: str, limit: int, extra_cut: int = 0) -> tuple[str, bool]:
    """Keep head and tail of ``text`` within ``limit`` chars; ``extra_cut`` counts chars already dropped."""
    if len(text) <= limit and not extra_cut:
        return text, False
    if len(text) <= limit:
        head, tail = text[: len(text) // 2], text[len(text) // 2:]
        cut = extra_cut
    else:
        head, tail = text[: limit // 2], text[len(text) - (limit - limit // 2):]
        cut = len(text) - limit + extra_cut
    return f"{head}\n[... {cut} chars cut ...]\n{tail}", True


class Output:
    """Bytes read for one command; keeps only head and tail once it grows past what could be shown.
    ``status`` and ``pwd`` come from the shell's status pipe, never from these bytes."""

    def __init__(self, limit_chars: int):
        self._keep = max(4 * limit_chars, 4096) + 8192  # 4 bytes/char worst case
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0
        self.status: int | None = None
        self.pwd: str | None = None

    def add(self, data: bytes) -> None:
        self.tail += data
        if len(self.tail) > 4 * self._keep:  # amortised: compact rarely
            if not self.head:
                self.head = self.tail[: self._keep]
                del self.tail[: self._keep]
            drop = len(self.tail) - self._keep
            self.dropped += drop
            del self.tail[:drop]

    def text(self) -> str:
        return (self.head + self.tail).decode("utf-8", errors="replace")
