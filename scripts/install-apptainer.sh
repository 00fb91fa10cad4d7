#!/usr/bin/env bash
# Apptainer for the singularity sandbox runtime, on a Debian that packages none (Debian 12), in a
# private prefix: nothing of the system's apt sources, packages or /etc is changed.
#
# Debian sid's apptainer (1.4.x) and squashfs-tools are downloaded through a private apt
# configuration (its own sources.list, state and cache under the prefix), unpacked with
# `dpkg -x` together with sid's libc6 and the few libraries they link, and their binaries are
# re-pointed with patchelf (the system release's own package, downloaded the same way when
# patchelf is not installed) at that libc: interpreter and DT_RPATH. Apptainer finds its
# configuration relative to its binary; the script writes it for this use: root in a container
# gets no capabilities (a node that withholds CAP_SYS_RESOURCE cannot hand out the default
# set), cgroups through cgroupfs where systemd is not init, loop devices shared per image.
#
# Idempotent: a second run checks the installed binary and prints its path. Prints the path of
# the working `apptainer` binary on stdout (progress goes to stderr); set PRORL_APPTAINER_BIN to
# it for the runtime. Needs apt-get, dpkg and the Debian mirror; not root.
#   PRORL_APPTAINER_PREFIX  where to install (default ~/.cache/prorl-celery/apptainer)
#   PRORL_APPTAINER_MIRROR  Debian mirror (default http://deb.debian.org/debian)
set -euo pipefail
prefix=${PRORL_APPTAINER_PREFIX:-${XDG_CACHE_HOME:-$HOME/.cache}/prorl-celery/apptainer}
mirror=${PRORL_APPTAINER_MIRROR:-http://deb.debian.org/debian}
root=$prefix/root
bin=$root/usr/bin/apptainer
recipe=2  # bump when what this script makes changes: older installs are made again
say() { echo "install-apptainer: $*" >&2; }

works() { [[ $(head -n1 "$root/.prorl-installed" 2>/dev/null) == "recipe $recipe" ]] &&
          "$bin" --version >/dev/null 2>&1; }
if works; then echo "$bin"; exit 0; fi
mkdir -p "$prefix"
exec 9>"$prefix/.lock"
flock 9  # one install at a time; a concurrent one may have finished meanwhile
if works; then echo "$bin"; exit 0; fi
for tool in apt-get dpkg; do
  command -v $tool >/dev/null 2>&1 || { say "needs $tool (a Debian system)"; exit 1; }
done
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
[[ -r $keyring ]] || { say "no $keyring to check the sid archive with"; exit 1; }
codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-stable}")

# -- a private apt: sid for apptainer, the system's own release for patchelf -----------------
apt=$prefix/apt
mkdir -p "$apt"/{state/lists/partial,cache/archives/partial,debs}
printf 'deb [signed-by=%s] %s sid main\ndeb [signed-by=%s] %s %s main\n' \
  "$keyring" "$mirror" "$keyring" "$mirror" "$codename" >"$apt/sources.list"
: >"$apt/state/status"
opts=(-o "Dir::Etc::sourcelist=$apt/sources.list" -o Dir::Etc::sourceparts=/nonexistent
      -o "Dir::State=$apt/state" -o "Dir::State::status=$apt/state/status"
      -o "Dir::Cache=$apt/cache" -o Debug::NoLocking=1 -o APT::Get::List-Cleanup=0)
[[ $(id -u) -eq 0 ]] && opts+=(-o APT::Sandbox::User=root)  # the private dirs are root's
say "reading the package lists of sid and $codename from $mirror"
apt-get "${opts[@]}" -qq update >&2
sid=(apptainer libc6 libgcc-s1 libseccomp2 libsqlite3-0 squashfs-tools liblz4-1 liblzma5
     liblzo2-2 libzstd1 zlib1g)
want=("${sid[@]/%//sid}")
command -v patchelf >/dev/null 2>&1 || want+=("patchelf/$codename")
rm -f "$apt"/debs/*.deb
(cd "$apt/debs" && apt-get "${opts[@]}" -qq download "${want[@]}" >&2)

# -- unpack into a fresh tree, patch, configure, then move it into place -----------------------
stage=$prefix/root.new
rm -rf "$stage" "$prefix/patchelf"
mkdir -p "$stage"
for deb in "$apt"/debs/*.deb; do
  case $(basename "$deb") in
    patchelf_*) dpkg -x "$deb" "$prefix/patchelf" ;;
    *) dpkg -x "$deb" "$stage" ;;
  esac
done
patchelf=$(command -v patchelf || echo "$prefix/patchelf/usr/bin/patchelf")
# Relocated, apptainer looks for etc/ and var/ beside its bin/ and one level above its libexec
# directory (the latter when a non-root user's SIF is extracted to a temporary sandbox).
ln -s ../etc "$stage/usr/etc"
ln -s ../var "$stage/usr/var"
ln -s ../../etc "$stage/usr/lib/etc"
ln -s ../../var "$stage/usr/lib/var"
mkdir -p "$stage/var/lib/apptainer/mnt/session"
lib=$root/usr/lib/x86_64-linux-gnu  # the final location: the stage is renamed to it
for elf in usr/bin/apptainer usr/lib/x86_64-linux-gnu/apptainer/bin/starter usr/bin/mksquashfs \
           usr/bin/unsquashfs; do
  "$patchelf" --set-interpreter "$lib/ld-linux-x86-64.so.2" --force-rpath --set-rpath "$lib" \
    "$stage/$elf"
done
conf=$stage/etc/apptainer/apptainer.conf
systemd=no
[[ -d /run/systemd/system ]] && systemd=yes
sed -i -e 's/^root default capabilities = .*/root default capabilities = no/' \
  -e "s/^systemd cgroups = .*/systemd cgroups = $systemd/" \
  -e 's/^max loop devices = .*/max loop devices = 4096/' \
  -e 's/^shared loop devices = .*/shared loop devices = yes/' \
  -e 's/^sessiondir max size = .*/sessiondir max size = 512/' "$conf"
echo "binary path = $root/usr/bin:\$PATH:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" >>"$conf"
rm -rf "$root"
mv "$stage" "$root"
version=$("$bin" --version) || { say "the unpacked apptainer does not run"; exit 1; }
printf 'recipe %s\n%s\n' "$recipe" "$version" >"$root/.prorl-installed"
say "$version in $root"
echo "$bin"
