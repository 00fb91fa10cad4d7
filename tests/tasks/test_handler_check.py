"""check_handler: every built-in handler conforms; a handler that the stages could not call is
refused when it is loaded, with a message naming what is wrong (fast, in process)."""
from __future__ import annotations

import pytest

from prorl_celery.errors import UnknownPlugin
from tasks.handlers import HANDLERS, get_handler
from tasks.handlers.check import check_handler, conform

pytestmark = pytest.mark.unit  # in process (tests/unit_tier.py)


@pytest.mark.parametrize("name", sorted(HANDLERS.entries))
def test_builtin_handlers_conform(name):
    check_handler(HANDLERS.load(name))
    assert get_handler(name).result_fields({}) is not None


def test_aliases_resolve_to_their_handler():
    assert type(get_handler("gsm8k")) is type(get_handler("math"))
    assert type(get_handler("swebench")) is type(get_handler("swe"))


class OnlyStages:
    def init(self, ctx): ...
    def run(self, ctx): ...
    def eval(self, ctx): return {"reward": 1.0, "resolved": True}


class NoEval:
    def init(self, ctx): ...
    def run(self, ctx): ...


class EvalIsData:
    def init(self, ctx): ...
    def run(self, ctx): ...
    eval = None


class EvalTakesTwo(OnlyStages):
    def eval(self, ctx, extra): ...


class NeedsArgs(OnlyStages):
    def __init__(self, url):
        self.url = url


class FieldsCrashOnEmptyState(OnlyStages):
    def result_fields(self, state):
        return {"turns": state["agent"]["turns"] + 1}


class FieldsNotJson(OnlyStages):
    def result_fields(self, state):
        return {"when": object()}


class HookWrongArity(OnlyStages):
    def on_exception(self, ctx): ...


def test_a_class_with_only_the_stages_conforms_and_gets_the_default_hooks():
    check_handler(OnlyStages)
    handler = conform(OnlyStages)()
    assert handler.result_fields({}) == {} and callable(handler.finish)


@pytest.mark.parametrize("cls, finding", [
    (NoEval, "eval is not a method"),
    (EvalTakesTwo, "eval(ctx) cannot be called"),
    (NeedsArgs, "cannot be created without arguments"),
    (FieldsCrashOnEmptyState, "result_fields({}) raised KeyError"),
    (FieldsNotJson, "result_fields({}) raised TypeError"),
    (HookWrongArity, "on_exception(ctx, exc) cannot be called"),
])
def test_nonconforming_handlers_are_refused_naming_the_problem(cls, finding):
    with pytest.raises(UnknownPlugin) as info:
        check_handler(cls)
    assert finding in str(info.value) and cls.__qualname__ in str(info.value)


def test_unknown_names_list_the_known_ones():
    with pytest.raises(UnknownPlugin) as info:
        HANDLERS.load("nope")
    message = str(info.value)
    assert "unknown handler 'nope'" in message and "math" in message and "gsm8k" in message


def test_loading_by_path_runs_the_check(monkeypatch):
    monkeypatch.setenv("PRORL_PLUGIN_PACKAGES", "tests")
    from config.settings import get_settings

    get_settings.cache_clear()
    try:
        assert HANDLERS.load("tests.tasks.test_handler_check:OnlyStages") is OnlyStages
        # no eval in the source: refused before anything is imported (prorl_celery/plugin_source.py)
        with pytest.raises(UnknownPlugin, match="its source shows no eval"):
            HANDLERS.load("tests.tasks.test_handler_check:NoEval")
        # an eval the source names but that is no method: imported, then refused by the check
        with pytest.raises(UnknownPlugin, match="does not conform: eval is not a method"):
            HANDLERS.load("tests.tasks.test_handler_check:EvalIsData")
    finally:
        get_settings.cache_clear()
