#!/usr/bin/env bash
# Install the agent harnesses once per sandbox node into a read-only directory that sandboxes see
# (bwrap binds /opt read-only): PRORL_HARNESS_ROOT, default /opt/prorl-harnesses.
#   bash scripts/install-harnesses.sh                 # mini-swe-agent (PyPI)
#   bash scripts/install-harnesses.sh mini-swe-agent  # the same, by name
#   bash scripts/install-harnesses.sh claude-code     # Claude Code (npm), for `-m harness`
#   bash scripts/install-harnesses.sh codex           # Codex (npm)
#   bash scripts/install-harnesses.sh openai-client   # a venv with the openai package, for `command`
#                                                     # harnesses such as examples/lookup_agent.py
# Python harnesses get a venv of the node's system python3 (/usr/bin/python3: the sandboxes run
# the node's /usr), so they run inside a sandbox as they do outside. Idempotent.
set -euo pipefail
root=${PRORL_HARNESS_ROOT:-/opt/prorl-harnesses}
python=${PRORL_HARNESS_PYTHON:-/usr/bin/python3}
wanted=("$@")
((${#wanted[@]})) || wanted=(mini-swe-agent)
mkdir -p "$root"
for name in "${wanted[@]}"; do
  case "$name" in
    mini-swe-agent|mini_swe_agent)
      dir="$root/mini-swe-agent"
      if [[ ! -x "$dir/bin/mini" ]]; then
        "$python" -m venv "$dir"
        # litellm 1.107.0 was a compromised release: never that one
        "$dir/bin/pip" install -q --disable-pip-version-check 'mini-swe-agent==2.4.6' 'litellm!=1.107.0'
      fi
      echo "mini-swe-agent: $dir/bin/mini" ;;
    claude-code|claude_code)
      # the npm package's JS wrapper wants Node >= 22; its native binary (an optional dependency,
      # @anthropic-ai/claude-code-linux-x64, ~360 MB) runs by itself
      dir="$root/claude-code"
      if [[ ! -d "$dir/node_modules/@anthropic-ai/claude-code" ]]; then
        npm install --prefix "$dir" --no-audit --no-fund --loglevel=error @anthropic-ai/claude-code
      fi
      echo "claude-code: $(find "$dir/node_modules/@anthropic-ai" -maxdepth 3 -type f -name claude -perm -u+x | head -1)" ;;
    codex)
      # its native binary comes in an optional dependency, @openai/codex-linux-x64 (~400 MB)
      dir="$root/codex"
      if [[ ! -d "$dir/node_modules/@openai/codex" ]]; then
        npm install --prefix "$dir" --no-audit --no-fund --loglevel=error @openai/codex
      fi
      echo "codex: $(find "$dir/node_modules/@openai" -type f -name codex -perm -u+x | head -1)" ;;
    openai-client|openai_client)
      dir="$root/openai-client"
      if [[ ! -x "$dir/bin/python" ]] || ! "$dir/bin/python" -c "import openai" 2>/dev/null; then
        "$python" -m venv "$dir"
        "$dir/bin/pip" install -q --disable-pip-version-check 'openai>=1.50'
      fi
      cp "$(dirname "$0")/../examples/lookup_agent.py" "$dir/lookup_agent.py"
      echo "openai-client: $dir/bin/python" ;;
    *) echo "install-harnesses: unknown harness $name (known: mini-swe-agent, claude-code, codex, openai-client)" >&2; exit 2 ;;
  esac
done
chmod -R a+rX,go-w "$root"
