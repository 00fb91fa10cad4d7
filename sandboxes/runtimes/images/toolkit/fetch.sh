#!/bin/sh
# curl and wget of the verifier toolkit (sandboxes/runtimes/images/verifier_tools.py); this one
# file is installed as both bin/curl and bin/wget and acts as the name it was called by.
#
# Tests install their runner with uv's standalone installer ("curl -LsSf
# https://astral.sh/uv/0.9.7/install.sh | sh"), whose host a sandbox cannot reach. A request for
# that installer is answered here with the toolkit's own (share/uv-installer.sh), which installs
# the uv this toolkit ships without downloading anything. Every other request goes, unchanged, to
# the real curl or wget found further along PATH.
set -f
me=${0##*/}
tools=$(cd "${0%/*}/.." 2>/dev/null && pwd -P) || tools=

# The uv version an installer URL asks for ("latest" without one), or status 1 for any other URL.
installer_version() {
    u=$1
    case $u in
        https://*) u=${u#https://} ;;
        http://*) u=${u#http://} ;;
        *://*) return 1 ;;
    esac
    case $u in
        astral.sh/uv/install.sh|github.com/astral-sh/uv/releases/latest/download/uv-installer.sh|\
        releases.astral.sh/github/uv/releases/latest/download/uv-installer.sh)
            echo latest; return 0 ;;
        astral.sh/uv/*/install.sh)
            v=${u#astral.sh/uv/}; v=${v%/install.sh} ;;
        github.com/astral-sh/uv/releases/download/*/uv-installer.sh)
            v=${u#github.com/astral-sh/uv/releases/download/}; v=${v%/uv-installer.sh} ;;
        releases.astral.sh/github/uv/releases/download/*/uv-installer.sh)
            v=${u#releases.astral.sh/github/uv/releases/download/}; v=${v%/uv-installer.sh} ;;
        *) return 1 ;;
    esac
    case $v in
        [0-9]*) ;;
        *) return 1 ;;
    esac
    case $v in
        *[!0-9A-Za-z.+-]*) return 1 ;;
    esac
    echo "$v"
}

# Whether short option letter $1 takes a value (so the rest of its cluster, or the next word, is
# that value and no further letter is an option).
takes_value() {
    if [ "$me" = wget ]; then
        case $1 in [OoaPtTweiBUQlARDXI]) return 0 ;; esac
    else
        case $1 in [AbcCdDeEFHKmoPQrtTuUwxXyYz]) return 0 ;; esac
    fi
    return 1
}

# Sets asked, out (a file, or - for stdout) and outdir from the command line.
parse() {
    asked='' out='' outdir='' remote=0
    while [ $# -gt 0 ]; do
        a=$1; shift
        if [ -z "$asked" ] && v=$(installer_version "$a"); then
            asked=$v url=$a
            continue
        fi
        case $me:$a in
            curl:--output|wget:--output-document) out=${1-}; [ $# -eq 0 ] || shift ;;
            wget:--output-document=*) out=${a#*=} ;;
            curl:--output-dir|wget:--directory-prefix) outdir=${1-}; [ $# -eq 0 ] || shift ;;
            wget:--directory-prefix=*) outdir=${a#*=} ;;
            curl:--remote-name|curl:--remote-name-all) remote=1 ;;
            *:--*|*:-) ;;
            *:-*) cluster "$a" "${1-}" && { [ $# -eq 0 ] || shift; } ;;
        esac
    done
}

# One cluster of short options ($1), the word after it ($2); status 0 when it took that word.
cluster() {
    rest=${1#-}
    while [ -n "$rest" ]; do
        c=${rest%"${rest#?}"}; rest=${rest#?}
        if [ "$me" = wget ] && [ "$c" = n ]; then rest=${rest#?}; continue; fi  # -nv, -nc, -nd ...
        [ "$me" = curl ] && [ "$c" = O ] && { remote=1; continue; }
        takes_value "$c" || continue
        value=$rest took=1
        [ -n "$value" ] && took=0 || value=$2
        case $me:$c in
            curl:o|wget:O) out=$value ;;
            wget:P) outdir=$value ;;
        esac
        [ "$took" = 1 ]
        return
    done
    return 1
}

# The installer, as the task's pipe or file receives it.
emit() {
    printf '#!/bin/sh\n'
    printf "PRORL_TOOLS='%s'\n" "$tools"
    printf "PRORL_ASKED_UV='%s'\n" "$asked"
    cat "$tools/share/uv-installer.sh"
}

serve() {
    if [ -z "$out" ] && { [ "$me" = wget ] || [ "$remote" = 1 ]; }; then
        out=${url##*/}  # curl -O, and wget by default, name the file after the URL
    fi
    if [ -n "$out" ] && [ "$out" != - ] && [ -n "$outdir" ]; then
        case $out in /*) ;; *) out=$outdir/$out ;; esac
    fi
    if [ -z "$out" ] || [ "$out" = - ]; then
        emit
    elif ! emit > "$out"; then
        echo "$me: could not write $out" >&2
        exit 23
    fi
    exit 0
}

# The real program: the first one on PATH after this toolkit's own entry (or, when this file was
# run by a path that is not on PATH, the first one at all). Never one before our own entry: a
# second copy of this wrapper there would hand the call back to us.
real() {
    passed=0 first='' after=''
    IFS=:
    for d in $PATH; do
        [ -n "$d" ] || continue
        c=$d/$me
        if [ "$c" -ef "$0" ]; then passed=1; continue; fi
        [ -f "$c" ] && [ -x "$c" ] || continue
        if [ "$passed" = 1 ]; then after=$c; break; fi
        [ -n "$first" ] || first=$c
    done
    unset IFS
    if [ "$passed" = 1 ]; then echo "$after"; else echo "$first"; fi
}

parse "$@"
if [ -n "$asked" ] && [ -n "$tools" ] && [ -f "$tools/share/uv-installer.sh" ]; then
    serve
fi
program=$(real)
if [ -z "$program" ]; then
    echo "$me: command not found (this sandbox has no $me; the verifier toolkit answers only uv's installer URLs)" >&2
    exit 127
fi
exec "$program" "$@"
