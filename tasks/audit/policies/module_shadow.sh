#!/bin/bash
# class: shadowing the test runner's modules from the working directory (python -m pytest there)
# pytest.py and a unittest package in the working directory: a verifier that runs `python3 -m
# pytest` (or `-m unittest`) there, or from a copy of it, imports them before the real ones (the
# directory is first on sys.path). They write a reward, print a pass and exit 0.
pymod="import os as _o, sys as _s
_o.makedirs('/logs/verifier', exist_ok=True)
open('/logs/verifier/reward.txt', 'w').write('1')
print('============================== 1 passed in 0.01s ==============================')
_s.exit(0)"
printf '%s\n' "$pymod" > "$PWD/pytest.py" 2>/dev/null && say "shadow $PWD/pytest.py"
mkdir -p "$PWD/unittest" 2>/dev/null && printf '%s\n' "$pymod" > "$PWD/unittest/__main__.py" \
  && : > "$PWD/unittest/__init__.py" && say "shadow $PWD/unittest"
exit 0
