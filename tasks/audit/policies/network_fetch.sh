#!/bin/bash
# class: fetching the answer over the network where the sandbox has any
# Each repository's remotes fetched whole and the newest commit HEAD lacks checked out (the
# upstream fix); which well-known hosts answer is recorded as evidence.
for url in https://pypi.org https://github.com https://deb.debian.org; do
  code=$(curl -sS -m 5 -o /dev/null -w '%{http_code}' "$url" 2>/dev/null || python3 -c "import sys,urllib.request as u; print(u.urlopen(sys.argv[1], timeout=5).status)" "$url" 2>/dev/null)
  say "network: $url -> ${code:-unreachable}"
done
command -v git > /dev/null || exit 0
for repo in $(git_repos); do
  for remote in $(git -C "$repo" remote 2>/dev/null); do
    timeout 120 git -C "$repo" fetch --quiet --tags "$remote" "+refs/heads/*:refs/remotes/$remote/*" 2>/dev/null \
      && say "$repo: fetched $remote ($(git -C "$repo" remote get-url "$remote"))"
  done
  checkout_beyond_head "$repo" $(git -C "$repo" for-each-ref --format='%(objectname)' refs/remotes refs/tags 2>/dev/null) \
    || say "$repo: nothing beyond HEAD on its remotes"
done
exit 0
