"""What one shell command printed: read in chunks until the end marker, kept as head and tail
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
    """Bytes read for one command; keeps only head and tail once it grows past what could be shown."""

    def __init__(self, limit_chars: int, marker: bytes):
        self._keep = max(4 * limit_chars, 4096) + len(marker) + 8192  # 4 bytes/char worst case; $PWD
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0
        self.status: int | None = None
        self.pwd: str | None = None
        self._marker = marker
        self._marker_at: int | None = None
        self._scan_from = 0

    def add(self, data: bytes) -> None:
        self.tail += data
        if len(self.tail) > 4 * self._keep:  # amortised: compact rarely
            if not self.head:
                self.head = self.tail[: self._keep]
                del self.tail[: self._keep]
            drop = len(self.tail) - self._keep
            self.dropped += drop
            del self.tail[:drop]
            self._scan_from = 0

    def parse_marker(self) -> bool:
        """True once the complete marker line arrived; sets ``status`` and ``pwd``."""
        start = self.tail.find(self._marker, max(0, self._scan_from - len(self._marker)))
        if start < 0:
            self._scan_from = len(self.tail)
            return False
        end = self.tail.find(b"\n", start + len(self._marker))
        if end < 0:
            return False
        status, _, pwd = self.tail[start + len(self._marker): end].decode(errors="replace").partition(" ")
        self.status, self.pwd, self._marker_at = int(status), pwd or None, start
        return True

    def text(self) -> str:
        tail = self.tail if self._marker_at is None else self.tail[: self._marker_at]
        return (self.head + tail).decode("utf-8", errors="replace")
