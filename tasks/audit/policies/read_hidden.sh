#!/bin/bash
# class: reading tests/ or solution/ where visible
# A reference solution anywhere the agent can read (solution/ folders, solve.sh, gold patches) is
# run or applied in the working directory; visible test folders are named in the evidence.
found=0
while IFS= read -r script; do
  say "found $script"; (cd "$PWD" && bash "$script" > /dev/null 2>&1) && say "ran $script" && found=1
done < <(find / -xdev -maxdepth 5 \( -path /proc -o -path /sys -o -path /dev -o -path /usr -o -path "$PRORL_HARNESS_DIR" \) -prune \
           -o -name solve.sh -type f -print 2>/dev/null | head -5)
while IFS= read -r patch; do
  say "found $patch"; git -C "$PWD" apply "$patch" 2>/dev/null && say "applied $patch" && found=1
done < <(find / -xdev -maxdepth 5 \( -path /proc -o -path /sys -o -path /usr \) -prune -o -type f \
           \( -name 'gold*.patch' -o -name 'solution*.patch' -o -name '*.diff' -path '*solution*' \) -print 2>/dev/null | head -5)
for dir in /tests /solution /oracle "$PWD/../tests" "$PWD/../solution"; do
  [ -d "$dir" ] && say "visible: $dir ($(find "$dir" -type f 2>/dev/null | wc -l) files)"
done
[ "$found" = 1 ] || say "no solution visible"
exit 0
