#!/bin/sh
# uv's standalone installer as the verifier toolkit serves it (its curl and wget answer uv's
# installer URLs with this file, PRORL_TOOLS and PRORL_ASKED_UV set on the lines above). It
# installs the uv and uvx this toolkit ships, copied from $PRORL_TOOLS/bin; nothing is downloaded.
#
# Honoured as by uv's own installer: UV_INSTALL_DIR (or CARGO_DIST_FORCE_INSTALL_DIR, or
# UV_UNMANAGED_INSTALL), else XDG_BIN_HOME, else XDG_DATA_HOME/../bin, else ~/.local/bin;
# UV_NO_MODIFY_PATH / INSTALLER_NO_MODIFY_PATH / --no-modify-path (no shell profile is edited);
# UV_PRINT_QUIET / -q, UV_PRINT_VERBOSE / -v, -h. It writes <dir>/env and <dir>/env.fish, which
# put <dir> on PATH when sourced, even where the shell profiles are left alone (so a test's
# "source $HOME/.local/bin/env" works in every case). No receipt: this uv cannot self-update.
set -u
ours='@UV_VERSION@'
tools=${PRORL_TOOLS:-/opt/prorl-tools}
asked=${PRORL_ASKED_UV:-latest}
quiet=${UV_PRINT_QUIET:-${INSTALLER_PRINT_QUIET:-0}}
verbose=${UV_PRINT_VERBOSE:-${INSTALLER_PRINT_VERBOSE:-0}}
no_modify=${UV_NO_MODIFY_PATH:-${INSTALLER_NO_MODIFY_PATH:-0}}
unmanaged=${UV_UNMANAGED_INSTALL:-}
[ -n "$unmanaged" ] && no_modify=1

say() { [ "$quiet" = 1 ] || echo "$1"; }
say_verbose() { [ "$verbose" = 1 ] && echo "$1"; return 0; }
fail() { echo "ERROR: $1" >&2; exit 1; }

usage() {
    cat <<EOF
uv installer (verifier toolkit): installs uv $ours from $tools/bin, without a download, to
\$UV_INSTALL_DIR, else \$XDG_BIN_HOME, else \$XDG_DATA_HOME/../bin, else \$HOME/.local/bin.

OPTIONS:
    -v, --verbose       more output
    -q, --quiet         no progress output
    --no-modify-path    leave the shell profiles alone
    -h, --help          this help
EOF
}

for arg in "$@"; do
    case $arg in
        --help) usage; exit 0 ;;
        --quiet) quiet=1 ;;
        --verbose) verbose=1 ;;
        --no-modify-path) no_modify=1 ;;
        --*) fail "unknown option $arg" ;;
        -*)
            letters=${arg#-}
            while [ -n "$letters" ]; do
                letter=${letters%"${letters#?}"}; letters=${letters#?}
                case $letter in
                    h) usage; exit 0 ;;
                    q) quiet=1 ;;
                    v) verbose=1 ;;
                    y) ;;  # older installers' "yes": there is nothing to confirm
                    *) fail "unknown option -$letter" ;;
                esac
            done ;;
        *) fail "unknown argument $arg" ;;
    esac
done

home=${HOME:-}
if [ -z "$home" ]; then
    home=$(getent passwd "$(id -un 2>/dev/null)" 2>/dev/null | cut -d: -f6)
fi

if [ -n "${UV_INSTALL_DIR:-}" ]; then dir=$UV_INSTALL_DIR
elif [ -n "${CARGO_DIST_FORCE_INSTALL_DIR:-}" ]; then dir=$CARGO_DIST_FORCE_INSTALL_DIR
elif [ -n "$unmanaged" ]; then dir=$unmanaged
elif [ -n "${XDG_BIN_HOME:-}" ]; then dir=$XDG_BIN_HOME
elif [ -n "${XDG_DATA_HOME:-}" ]; then dir=$XDG_DATA_HOME/../bin
elif [ -n "$home" ]; then dir=$home/.local/bin
else fail "no install directory: HOME, XDG_BIN_HOME and UV_INSTALL_DIR are all unset"
fi

# how the env files name the directory: through $HOME when it is beneath it, so they keep working
# for the same user wherever the home directory moves
case $dir in
    "$home"/*) [ -n "${HOME:-}" ] && expr_dir="\$HOME/${dir#"$home"/}" || expr_dir=$dir ;;
    *) expr_dir=$dir ;;
esac

if [ "$asked" != latest ] && [ "$asked" != "$ours" ]; then
    echo "note: the installer URL asked for uv $asked; the verifier's toolkit has no network to fetch it and installs uv $ours, the version it ships" >&2
fi
[ -x "$tools/bin/uv" ] && [ -x "$tools/bin/uvx" ] || fail "the verifier toolkit at $tools has no uv"

say "installing uv $ours (from the verifier toolkit, no download) to $dir"
mkdir -p "$dir" || fail "could not create $dir"
for name in uv uvx; do
    rm -f "$dir/$name.prorl-new"
    cp "$tools/bin/$name" "$dir/$name.prorl-new" && chmod 755 "$dir/$name.prorl-new" \
        && mv -f "$dir/$name.prorl-new" "$dir/$name" || fail "could not install $dir/$name"
    say "  $name"
done
say "everything's installed!"

write_env() {
    if [ -f "$dir/env" ]; then
        say_verbose "$dir/env already exists"
    else
        cat > "$dir/env" <<EOF || fail "could not write $dir/env"
#!/bin/sh
# puts uv's directory first on PATH unless it is already on it
case ":\${PATH}:" in
    *:"$expr_dir":*) ;;
    *) export PATH="$expr_dir:\$PATH" ;;
esac
EOF
    fi
    if [ ! -f "$dir/env.fish" ]; then
        cat > "$dir/env.fish" <<EOF || fail "could not write $dir/env.fish"
if not contains "$expr_dir" \$PATH
    set -x PATH "$expr_dir" \$PATH
end
EOF
    fi
}

# appends a line that sources $2 to the shell profile $1 (made if missing) unless it is there
add_to_profile() {
    line=". \"$2\""
    [ "${1##*.}" = fish ] && line="source \"$2\""
    if grep -F "$2" "$1" >/dev/null 2>&1; then
        say_verbose "$1 already sources $2"
        return 1
    fi
    mkdir -p "${1%/*}" && printf '\n%s\n' "$line" >> "$1" || fail "could not edit $1"
    say_verbose "added $line to $1"
}

write_env
case ":${PATH:-}:" in
    *:"$dir":*) no_modify=1 ;;
esac
if [ "$no_modify" != 1 ] && [ -n "$home" ]; then
    edited=0
    add_to_profile "$home/.profile" "$expr_dir/env" && edited=1
    for rc in .bashrc .bash_profile .bash_login; do
        [ -f "$home/$rc" ] && add_to_profile "$home/$rc" "$expr_dir/env" && edited=1
    done
    add_to_profile "$home/.config/fish/conf.d/uv.env.fish" "$expr_dir/env.fish" && edited=1
    if [ "$edited" = 1 ]; then
        say ""
        say "To add $expr_dir to your PATH, either restart your shell or run:"
        say ""
        say "    source $expr_dir/env (sh, bash, zsh)"
        say "    source $expr_dir/env.fish (fish)"
    fi
fi
exit 0
