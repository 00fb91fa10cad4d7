"""The Dockerfile parser and planner (sandboxes/runtimes/images/dockerfile.py, plan.py), the base
map and .dockerignore: pure functions, in process."""
from __future__ import annotations

import pytest

from prorl_celery.errors import ImageBuildFailed, ProrlError
from sandboxes.runtimes.images import context as ctx
from sandboxes.runtimes.images.bases import mapped
from sandboxes.runtimes.images.dockerfile import parse
from sandboxes.runtimes.images.words import word, words
from sandboxes.runtimes.images.plan import DEFAULT_PATH, plan

pytestmark = pytest.mark.unit  # in process (tests/unit_tier.py)

BASE_MAP = {"ubuntu:*": "debian:bookworm", "debian:*": "debian:bookworm", "python:3*": "debian:bookworm",
            "buildpack-deps:*": "debian:bookworm"}


def _env(values: dict[str, str]):
    return values.get


# -- syntax ---------------------------------------------------------------------------------------
def test_continuations_comments_and_line_numbers():
    text = ("# syntax=docker/dockerfile:1\n\nFROM ubuntu:24.04\n# a comment\n"
            "RUN apt-get update && \\\n    # inside the continuation\n\n    apt-get install -y jq\nWORKDIR /app\n")
    found = parse(text).instructions
    assert [(i.cmd, i.line) for i in found] == [("FROM", 3), ("RUN", 5), ("WORKDIR", 9)]
    assert found[1].args == "apt-get update &&     apt-get install -y jq"


def test_escape_directive_backtick():
    found = parse("# escape=`\nFROM scratch\nRUN echo a `\n  b\nCOPY c:\\dir\\x /x\n").instructions
    assert found[1].args == "echo a   b"
    assert found[2].args == "c:\\dir\\x /x"


def test_a_directive_after_a_comment_is_a_comment():
    dockerfile = parse("# hello\n# escape=`\nFROM scratch\nRUN a \\\n b\n")
    assert dockerfile.escape == "\\"
    assert dockerfile.instructions[1].args == "a  b"


def test_bad_escape_directive():
    with pytest.raises(ImageBuildFailed, match="escape"):
        parse("# escape=x\nFROM scratch\n")


def test_keywords_are_case_insensitive_and_flags_split():
    ins = parse("from ubuntu\ncopy --chown=app:app --chmod=644 a b /x/\n").instructions
    assert ins[0].cmd == "FROM"
    assert ins[1].flags == {"chown": "app:app", "chmod": "644"}
    assert ins[1].args == "a b /x/"


def test_exec_and_shell_forms():
    ins = parse('FROM x\nCMD ["python", "-m", "http.server"]\nCMD python -m http.server\nCMD [bad json\n').instructions
    assert ins[1].exec_form() == ["python", "-m", "http.server"]
    assert ins[2].exec_form() is None
    assert ins[3].exec_form() is None  # not JSON: the shell form, as Docker


def test_heredocs():
    text = "FROM x\nRUN <<EOF\necho one\n# not a comment here\nEOF\nRUN cat <<-'END' > /f\n\tbody $X\n\tEND\nWORKDIR /w\n"
    ins = parse(text).instructions
    assert ins[1].heredocs[0].body == "echo one\n# not a comment here\n"
    doc = ins[2].heredocs[0]
    assert (doc.name, doc.body, doc.quoted, doc.strip_tabs) == ("END", "body $X\n", True, True)
    assert ins[3].cmd == "WORKDIR" and ins[3].line == 9


def test_unclosed_heredoc_is_an_error():
    with pytest.raises(ImageBuildFailed, match="never closed"):
        parse("FROM x\nRUN <<EOF\necho\n")


def test_unknown_instruction_names_itself_and_its_line():
    with pytest.raises(ImageBuildFailed, match=r"line 3 \(FROBNICATE\).*unknown instruction"):
        parse("FROM x\n\nFROBNICATE now\n")


# -- words ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("$A", ["1"]), ("${A}x", ["1x"]), ("${B:-dflt}", ["dflt"]), ("${E:-dflt}", ["dflt"]), ("${E-dflt}", [""]),
    ("${B-dflt}", ["dflt"]), ("${A:+set}", ["set"]), ("${B:+set}", [""]), ("'$A'", ["$A"]), ('"$A b"', ["1 b"]),
    ("a\\ b", ["a b"]), ("\\$A", ["$A"]), ("x  y", ["x", "y"]), ("$", ["$"]), ("${A:-${E:-in}}", ["1"]),
    ("${B:-${A}}", ["1"]),
])
def test_substitution(text, expected):
    assert words(text, _env({"A": "1", "E": ""})) == expected


def test_word_keeps_spaces_and_required_variable_fails():
    assert word('"/my dir"/$A', _env({"A": "x"})) == "/my dir/x"
    with pytest.raises(ImageBuildFailed, match="B: must be set"):
        word("${B:?must be set}", _env({}))
    with pytest.raises(ImageBuildFailed, match="unmatched"):
        words('"open', _env({}))


# -- the plan ------------------------------------------------------------------------------------
def test_cookbook_like_plan():
    p = plan("FROM ubuntu:24.04\nRUN apt-get update && apt-get install -y jq\nWORKDIR /app\nCOPY x.txt /app/\nENV FOO=bar\n")
    stage = p.target
    assert stage.from_ref == "ubuntu:24.04" and p.external_refs() == ["ubuntu:24.04"]
    run, workdir, copy = stage.steps
    assert run.argv == ["/bin/sh", "-c", "apt-get update && apt-get install -y jq"]
    assert run.env == {"PATH": DEFAULT_PATH} and run.workdir == "/"
    assert workdir.kind == "workdir" and workdir.workdir == "/app"
    assert copy.sources == ["x.txt"] and copy.dest == "/app/"
    assert stage.env == {"PATH": DEFAULT_PATH, "FOO": "bar"} and stage.workdir == "/app"


def test_args_before_from_build_args_and_scoping():
    text = ("ARG BASE=ubuntu\nARG TAG=22.04\nFROM ${BASE}:${TAG}\nRUN echo $TAG\nARG TAG\nARG V=1\n"
            "RUN echo $TAG $V\n")
    p = plan(text, {"TAG": "24.04"})
    first, second = p.target.steps
    assert p.target.from_ref == "ubuntu:24.04"
    assert "TAG" not in first.env  # a global ARG is not in a stage until declared there
    assert second.env["TAG"] == "24.04" and second.env["V"] == "1"
    assert p.notes == []
    assert plan("FROM x\n", {"NOPE": "1"}).notes == ["build args never declared by an ARG: NOPE"]


def test_env_forms_and_env_over_arg():
    text = 'FROM x\nARG A=arg\nENV A=env B="two words" C=$A\nENV LEGACY value with  spaces\nRUN true\n'
    p = plan(text)
    env = p.target.steps[0].env
    assert env["A"] == "env" and env["B"] == "two words" and env["C"] == "arg"  # C saw A before this ENV
    assert env["LEGACY"] == "value with  spaces"


def test_base_env_and_path_extension():
    p = plan("FROM python:3.12\nENV PATH=/opt/venv/bin:$PATH\n", base_env=lambda ref: {"PATH": "/usr/bin", "X": ref})
    assert p.target.env == {"PATH": "/opt/venv/bin:/usr/bin", "X": "python:3.12"}


def test_workdir_relative_and_variables():
    p = plan("FROM x\nENV D=data\nWORKDIR /a\nWORKDIR b/$D\nCOPY f ./\nCOPY g h\n")
    assert p.target.workdir == "/a/b/data"
    assert p.target.steps[2].dest == "/a/b/data/" and p.target.steps[3].dest == "/a/b/data/h"


def test_shell_changes_later_runs_and_must_be_json():
    p = plan('FROM x\nRUN a\nSHELL ["/bin/bash", "-eo", "pipefail", "-c"]\nRUN b\nRUN ["exec", "form"]\n')
    assert [s.argv for s in p.target.steps] == [["/bin/sh", "-c", "a"], ["/bin/bash", "-eo", "pipefail", "-c", "b"],
                                                ["exec", "form"]]
    with pytest.raises(ImageBuildFailed, match="SHELL must be written as a JSON array"):
        plan("FROM x\nSHELL /bin/bash -c\n")


def test_run_heredoc_forms():
    p = plan("FROM x\nRUN <<EOF\nset -e\necho hi\nEOF\nRUN <<EOF\n#!/usr/bin/env python3\nprint(1)\nEOF\n"
             "RUN python3 <<EOF\nprint(2)\nEOF\n")
    plain, shebang, fed = p.target.steps
    assert plain.argv == ["/bin/sh", "-c", "set -e\necho hi\n"]
    assert shebang.script == "#!/usr/bin/env python3\nprint(1)\n"
    assert fed.argv == ["/bin/sh", "-c", "python3 <<EOF\nprint(2)\nEOF\n"]


def test_copy_heredoc_expands_unless_quoted():
    p = plan("FROM x\nARG V=7\nCOPY <<EOF /etc/a\nv=$V\nEOF\nCOPY <<'EOF' /etc/b\nv=$V\nEOF\n")
    assert p.target.steps[0].inline == {"EOF": "v=7\n"} and p.target.steps[0].sources == []
    assert p.target.steps[1].inline == {"EOF": "v=$V\n"}


def test_multi_stage_copy_from_and_needed_stages():
    text = ("FROM debian:12 AS build\nRUN make\nFROM scratch AS unused\nFROM python:3.12-slim\n"
            "COPY --from=build /out /app\nCOPY --from=ghcr.io/astral-sh/uv:latest /uv /bin/\n")
    p = plan(text)
    copy, other = p.target.steps
    assert copy.from_stage == 0 and other.from_image == "ghcr.io/astral-sh/uv:latest"
    assert p.needed == [0, 2]
    assert p.external_refs() == ["debian:12", "python:3.12-slim", "ghcr.io/astral-sh/uv:latest"]
    derived = plan("FROM x AS a\nENV K=v\nWORKDIR /w\nFROM a\n").target
    assert derived.base_stage == 0 and derived.env["K"] == "v" and derived.workdir == "/w"


def test_metadata_is_recorded():
    text = ('FROM x\nCMD ["a"]\nENTRYPOINT /entry.sh\nEXPOSE 80 443/tcp\nLABEL a=b "c d"=e\nMAINTAINER me\n'
            'VOLUME ["/data"]\nSTOPSIGNAL SIGTERM\nHEALTHCHECK --interval=5s CMD true\nONBUILD RUN x\nUSER app\n')
    stage = plan(text).target
    config = stage.config
    assert config.cmd == ["a"] and config.entrypoint == ["/bin/sh", "-c", "/entry.sh"]
    assert config.expose == ["80", "443/tcp"] and config.labels == {"a": "b", "c d": "e", "maintainer": "me"}
    assert config.volumes == ["/data"] and config.stopsignal == "SIGTERM"
    assert config.healthcheck == {"test": "CMD true", "interval": "5s"} and config.onbuild == ["RUN x"]
    assert stage.user == "app"


def test_run_after_user_is_noted():
    stage = plan("FROM x\nUSER app\nRUN id\n").target
    assert stage.notes == ["RUN at line 3 ran as root, not as USER app"]


@pytest.mark.parametrize("text, match", [
    ("RUN x\n", "only ARG may come before the first FROM"),
    ("# nothing\n", "no FROM"),
    ("FROM x\nRUN --mount=type=secret,id=a cat /run/secrets/a\n", r"line 2 \(RUN\).*type=cache"),
    ("FROM x\nCOPY --parents a /b\n", r"line 2 \(COPY\).*--parents"),
    ("FROM x\nADD --keep-git-dir=true https://x/y.git /y\n", "--keep-git-dir"),
    ("FROM x\nRUN --network=bridge x\n", "--network=bridge"),
    ("FROM x\nCOPY a\n", "needs a source and a destination"),
    ("FROM x\nCOPY --chmod=u+x a /b\n", "octal"),
    ("FROM x y\n", "FROM takes an image"),
    ("FROM x\nENV\n", "needs a name"),
    ("FROM x\nENV A\n", "has no value"),
    ("FROM x\nENV =v\n", "not name=value"),
])
def test_refusals_name_the_instruction(text, match):
    with pytest.raises(ImageBuildFailed, match=match) as info:
        plan(text)
    assert isinstance(info.value, ProrlError) and info.value.type == "image_build_failed"


def test_run_network_and_cache_mount():
    p = plan("FROM x\nRUN --network=none true\nRUN --mount=type=cache,target=/root/.cache pip install x\n")
    assert p.target.steps[0].network is False and p.target.steps[1].network is None
    assert any("--mount" in note for note in p.target.notes)


# -- the base map and .dockerignore ---------------------------------------------------------------
@pytest.mark.parametrize("ref, expected", [
    ("ubuntu:24.04", "debian:bookworm"), ("ubuntu", "debian:bookworm"), ("docker.io/library/ubuntu:22.04", "debian:bookworm"),
    ("python:3.12-slim", "debian:bookworm"), ("python:3.11-slim-bookworm", "debian:bookworm"),
    ("buildpack-deps:jammy", "debian:bookworm"), ("python:2.7", None), ("ghcr.io/x/y:1", None),
    ("node:20", None),
])
def test_base_map(ref, expected):
    assert mapped(ref, BASE_MAP) == expected


def test_slim_variant_of_an_exact_pattern():
    assert mapped("node:20-slim", {"node:20": "debian:bookworm"}) == "debian:bookworm"


def test_dockerignore(tmp_path):
    (tmp_path / ".dockerignore").write_text("# comment\n*.log\n/build\n**/secret*\n!keep.log\ndocs/*.md\n")
    patterns = ctx.ignore_patterns(tmp_path)
    verdicts = {rel: ctx.ignored(rel, patterns) for rel in (
        "a.log", "keep.log", "sub/a.log", "build", "build/x", "x/secret.txt", "secret", "docs/a.md",
        "docs/sub/a.md", "src/main.py")}
    assert verdicts == {"a.log": True, "keep.log": False, "sub/a.log": False, "build": True, "build/x": True,
                        "x/secret.txt": True, "secret": True, "docs/a.md": True, "docs/sub/a.md": False,
                        "src/main.py": False}


def test_context_files_and_digest(tmp_path):
    (tmp_path / ".dockerignore").write_text("ignored.txt\n")
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "ignored.txt").write_text("x")
    listed = ctx.files(tmp_path)
    assert listed == [".dockerignore", "a.txt"]
    before = ctx.digest(tmp_path, listed)
    (tmp_path / "ignored.txt").write_text("changed")
    assert ctx.digest(tmp_path, ctx.files(tmp_path)) == before  # what is ignored is not in the key
    (tmp_path / "a.txt").chmod(0o600)
    assert ctx.digest(tmp_path, ctx.files(tmp_path)) != before  # the mode is


def test_unmapped_reference_without_an_allowed_registry_is_refused(monkeypatch):
    from config.settings import get_settings
    from sandboxes.runtimes.images.bases import resolve

    monkeypatch.setenv("PRORL_SANDBOX_REGISTRIES", "")
    monkeypatch.setenv("PRORL_IMAGE_BASE_MAP", '{"ubuntu:*": "debian:bookworm"}')
    get_settings.cache_clear()
    try:
        with pytest.raises(ImageBuildFailed) as info:
            resolve("ghcr.io/x/y", deadline=0)
        mapped_base = resolve("ubuntu:24.04", deadline=0)
        with pytest.raises(ImageBuildFailed, match="PRORL_IMAGE_BASE_MAP maps"):
            monkeypatch.setenv("PRORL_IMAGE_BASE_MAP", '{"ubuntu:*": "alpine:3"}')
            get_settings.cache_clear()
            resolve("ubuntu:24.04", deadline=0)
    finally:
        get_settings.cache_clear()
    text = str(info.value)
    assert "ghcr.io/x/y" in text and "PRORL_IMAGE_BASE_MAP" in text and "PRORL_SANDBOX_REGISTRIES" in text
    assert mapped_base.description == "debian:bookworm (mmdebstrap) for ubuntu:24.04"
    assert mapped_base.notes == ["ubuntu:24.04 built as debian:bookworm"]
