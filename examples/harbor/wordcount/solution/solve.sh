#!/bin/bash
cat > /app/wordcount.py <<'PY'
from collections import Counter


def top_words(path, k):
    with open(path) as f:
        counts = Counter(word.lower() for word in f.read().split())
    return sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:k]
PY
