"""The bash text of :mod:`sandboxes.runtimes.shell.persistent`: the setup script its parent sources at
start, the runner it evals for each command and the trap that carries a command's state to the
next. Pure strings, no I/O; how they fit together is told in that module's docstring."""
from __future__ import annotations

import re

VALID_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
PLACEHOLDER = "-" * 12  # where a state file's first line gets its command's token, written last
_STATE_HEAD = 14  # len("#" + token + " ")


def shell_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


# The EXIT trap of a command's subshell: its state for the next command, in builtins only.
# It goes to the spare file ($__prorl_N), never over the one the next command would otherwise
# source; the first line is "#<placeholder> <cwd>" and the command's token ($__prorl_t)
# replaces the placeholder in place ("1<>": no truncation) after everything else was written,
# so the parent takes a file whose first line carries this command's token as complete, and
# keeps the previous state for a subshell killed before or while it dumps. What equals the
# parent's own baseline (options, exported variables) is left out: the next subshell inherits
# it by fork, which is cheaper than sourcing it. Safe under the agent's "set -eu"; options
# last, so that a restored "set -e" applies only after the rest was sourced.
_DUMP_TRAP = ("{ builtin printf '#%s %s\\nbuiltin cd -- %q\\n' " + PLACEHOLDER + " \"$PWD\" \"$PWD\"; "
              "[[ ${OLDPWD+x} ]] && builtin printf 'OLDPWD=%q\\n' \"$OLDPWD\"; "
              "builtin export -n PWD OLDPWD; builtin export -p >|\"$__prorl_B.e\"; "
              "IFS= builtin read -r -d '' __prorl_x <\"$__prorl_B.e\" || :; "
              "[[ \"$__prorl_x\" == \"${__prorl_E-}\" ]] || "
              "builtin printf 'builtin unset -v %s\\n%s' \"${__prorl_X-}\" \"$__prorl_x\"; "
              "builtin declare -f; builtin alias -p; "
              "[[ \"$SHELLOPTS $BASHOPTS\" == \"${__prorl_O-}\" ]] || { builtin shopt -p; builtin set +o; }; "
              "} >|\"$__prorl_N\" 2>/dev/null; "
              "builtin printf '#%s' \"${__prorl_t-}\" 1<>\"$__prorl_N\" 2>/dev/null")


def runner(status_fd: int) -> str:
    """What the parent evals for each command ($__prorl_k, token $__prorl_t). It is sent once,
    at start: bash reads its stdin pipe a byte at a time, so each command's line is kept to
    the token and the command. The eval is the subshell's last command, so its status is the
    subshell's: the state is dumped by an EXIT trap set before any of the agent's code exists
    there. The parent swaps in the new state file only if it carries this command's token."""
    return (f"{{ ( exec 0</dev/null 2>&1 {status_fd}>&-; builtin trap \"$__prorl_T\" EXIT; "
            "builtin . \"$__prorl_S\" >/dev/null 2>&1; builtin eval \"$__prorl_k\" ); } 2>/dev/null; "
            "__prorl_s=$?; if IFS= builtin read -r __prorl_p <\"$__prorl_N\" && "
            f"[[ \"${{__prorl_p:0:{_STATE_HEAD}}}\" == \"#$__prorl_t \" ]]; then "
            f"__prorl_c=${{__prorl_p:{_STATE_HEAD}}} __prorl_p=$__prorl_S; __prorl_S=$__prorl_N; "
            "__prorl_N=$__prorl_p; fi 2>/dev/null; "
            f"builtin printf '%s %d %s\\n' \"$__prorl_t\" \"$__prorl_s\" \"$__prorl_c\" >&{status_fd}")


# After each of the host's own (raw) commands: the parent's state becomes the baseline the
# commands' subshells inherit, and the carried state starts afresh from it (raw commands run
# only before any agent command: start, limits, adopt, the cd of a restart). A subshell dumps
# the exported variables with PWD and OLDPWD unexported, which leaves the parent's untouched.
_BASELINE_DUMP = ("builtin export -n PWD OLDPWD; builtin export -p >|\"$__prorl_B.e\"; "
                  "builtin compgen -e >|\"$__prorl_B.x\"")
# The part of the take that follows the cwd alone: what a raw command that exports nothing and
# sets no option (a cd, a ulimit) changes of the baseline, taken without forking a dump.
_TAKE_CWD = "__prorl_c=$PWD; builtin printf '#%s %s\\n' " + PLACEHOLDER + " \"$PWD\" >|\"$__prorl_S\""
_BASELINE_TAKE = (_TAKE_CWD + "; "
                  "IFS= builtin read -r -d '' __prorl_E <\"$__prorl_B.e\"; "
                  "builtin mapfile -t __prorl_a <\"$__prorl_B.x\"; __prorl_X=\"${__prorl_a[*]}\"; "
                  "__prorl_O=\"$SHELLOPTS $BASHOPTS\"")
_REBASE = f"( {_BASELINE_DUMP} ) 2>/dev/null; {_BASELINE_TAKE}"
REBASES = {"full": "__prorl_Z", "cwd": "__prorl_Y"}  # rebase kind -> the setup's variable holding it
STATE_SUFFIXES = (".0", ".1", ".e", ".x")


def setup_script(state_name: str, status_fd: int) -> str:
    """What the parent sources first: the dump trap, the runner, the two rebases and the init
    ($__prorl_I) as variables. The init runs last in the start's line, after the runtime's own
    commands: one subshell makes the state files, dumps the baseline and finds out whether
    another process of the sandbox's user can reach the parent's fds. Its status is nonzero if
    the state files could not be made."""
    init = ("(builtin umask 077; builtin set -C; "
            "for f in \"$__prorl_B\"{.0,.1,.e,.x}; do : >\"$f\" || builtin exit 1; done; "
            f"{{ {_BASELINE_DUMP}; }} 2>/dev/null; "
            "{ builtin read -r -n0 </proc/$$/environ; } 2>/dev/null || builtin exit 2); "
            "case $? in 0) __prorl_D=dumpable;; 2) __prorl_D=non-dumpable;; *) __prorl_D=;; esac; "
            f"[[ -n $__prorl_D ]] && {{ {_BASELINE_TAKE}; }}")
    return f"""__prorl_B=${{TMPDIR:-/tmp}}; [[ -d /dev/shm && -w /dev/shm ]] && __prorl_B=/dev/shm
__prorl_B="$__prorl_B/{state_name}"; __prorl_S="$__prorl_B.0" __prorl_N="$__prorl_B.1"
__prorl_T={shell_quote(_DUMP_TRAP)}
__prorl_R={shell_quote(runner(status_fd))}
__prorl_Z={shell_quote(_REBASE)}
__prorl_Y={shell_quote(_TAKE_CWD)}
__prorl_I={shell_quote(init)}
"""
