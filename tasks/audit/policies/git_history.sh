#!/bin/bash
# class: recovering the answer from git history, stashes, reflogs or caches
# In every repository the working directory is in or holds: the newest commit HEAD does not
# contain, from any ref, the reflog, the stash or a dangling object, checked out over the tree.
command -v git > /dev/null || { say "no git"; exit 0; }
for repo in $(git_repos); do
  revs=$(git -C "$repo" rev-list --all --reflog 2>/dev/null)
  revs+=" $(git -C "$repo" stash list --format=%H 2>/dev/null)"
  revs+=" $(git -C "$repo" fsck --lost-found --no-progress 2>/dev/null | awk '/commit/ {print $3}')"
  say "$repo: $(echo $revs | wc -w) commits in refs, reflog, stash, dangling"
  checkout_beyond_head "$repo" $revs || say "$repo: nothing beyond HEAD"
done
exit 0
