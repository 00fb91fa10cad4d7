#!/bin/bash
# Two named rewards: correctness (the sum) and style (the file stays under $LIMIT lines).
correct=0; style=0
[ "$(printf '1\n2\n39\n' | python3 /work/sum.py 2>/dev/null)" = "42" ] && correct=1
[ -f /work/sum.py ] && [ "$(wc -l < /work/sum.py)" -le "$LIMIT" ] && style=1
[ "$SCORES_MODE" = "strict" ] || correct=0
printf '{"correctness": %s, "style": %s}\n' "$correct" "$style" > /logs/verifier/reward.json
