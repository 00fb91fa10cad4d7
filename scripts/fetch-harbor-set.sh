#!/usr/bin/env bash
# The Harbor task set of tests/harbor/harbor_set.json, on this machine: the repository it names at
# its commit, and of it only the listed task folders, extracted under DEST/<commit>/tasks. Prints
# that directory (give it to the test as PRORL_HARBOR_SET); progress goes to stderr.
#
#   scripts/fetch-harbor-set.sh [GIT_DIR]
#     GIT_DIR  a local clone or bare mirror of the repository holding the commit (where GitHub
#              cannot be reached); without it the commit is fetched from the repository's URL.
#   PRORL_HARBOR_SET_DEST  where to extract (default /var/cache/prorl-harbor-set)
#
# Idempotent: a finished extraction (its .complete marker) is printed again as it is.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
spec=$here/tests/harbor/harbor_set.json
read_spec() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); $1" "$spec"; }
url=$(read_spec 'print(d["repository"])')
commit=$(read_spec 'print(d["commit"])')
mapfile -t paths < <(read_spec 'print("\n".join(t["path"] for t in d["tasks"]))')
dest=${PRORL_HARBOR_SET_DEST:-/var/cache/prorl-harbor-set}/$commit/tasks
if [[ -f $dest/.complete ]] && cmp -s "$dest/.complete" <(printf '%s\n' "${paths[@]}"); then
    echo "$dest"; exit 0
fi
gitdir=${1:-}
if [[ -z $gitdir ]]; then
    gitdir=$(mktemp -d)
    trap 'rm -rf "$gitdir"' EXIT
    echo "fetching $commit from $url" >&2
    git init -q --bare "$gitdir"
    git --git-dir="$gitdir" fetch -q --depth 1 "$url" "$commit"
fi
git --git-dir="$gitdir" cat-file -e "$commit^{commit}" || { echo "$gitdir lacks commit $commit" >&2; exit 1; }
mkdir -p "$(dirname "$dest")"
tmp=$(mktemp -d "$(dirname "$dest")/.extract.XXXXXX")
git --git-dir="$gitdir" archive "$commit" -- "${paths[@]}" | tar -x -C "$tmp"
printf '%s\n' "${paths[@]}" > "$tmp/.complete"
rm -rf "$dest"
mv "$tmp" "$dest"
echo "extracted ${#paths[@]} tasks of $url@$commit" >&2
echo "$dest"
