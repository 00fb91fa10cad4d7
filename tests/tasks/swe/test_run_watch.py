"""The runners' watch (:mod:`tasks.swe.runners.run_watch`): the check of each test's function against
the code compiled from the sources read before the package loaded (in process), and the audit
hook that notes profile and trace hooks and replaced ``__code__`` (in a process of its own, as the
runners start it: an audit hook cannot be removed)."""
from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.swe.runners import run_watch

TESTS = '''import functools


def wraps_it(func):
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        return func(*args, **kwargs)
    return wrapper


def hides_it(func):
    def wrapper(*args, **kwargs):
        return func(*args, **kwargs)
    return wrapper


def test_plain():
    assert 1 + 1 == 2


def test_other():
    assert 2 + 2 == 4


@wraps_it
def test_wrapped():
    assert 3 == 3


@hides_it
def test_hidden():
    assert 4 == 4


class TestBase:
    def test_inherited(self):
        assert True


class TestChild(TestBase):
    def test_own(self):
        assert True


test_alias = test_plain
'''


@pytest.fixture
def loaded(tmp_path):
    """(the watch, the file, its namespace as the test module's body left it)."""
    path = tmp_path / "test_m.py"
    path.write_text(TESTS)
    watch = run_watch.Watch(str(tmp_path))
    watch.read([str(tmp_path)])
    namespace: dict = {"__name__": "test_m"}
    exec(compile(TESTS, str(path), "exec", dont_inherit=True), namespace)  # as an importer compiles it
    return watch, str(path), namespace


def _check(watch, path, namespace, name, cls=None):
    owners = [(path, "")] if cls is None else [(path, k.__qualname__) for k in namespace[cls].__mro__[:-1]]
    func = namespace[name] if cls is None else next(vars(k)[name] for k in namespace[cls].__mro__ if name in vars(k))
    if cls is not None:  # the owner first: the class whose dict has it
        owner = next(k for k in namespace[cls].__mro__ if name in vars(k))
        owners = [(path, owner.__qualname__)] + [o for o in owners if o[1] != owner.__qualname__]
    return watch.check(f"{cls}.{name}" if cls else name, func, owners, name)


@pytest.mark.unit
def test_each_test_made_by_its_def_is_ok(loaded):
    watch, path, namespace = loaded
    assert [_check(watch, path, namespace, n) for n in ("test_plain", "test_other", "test_wrapped")] == ["ok"] * 3
    assert _check(watch, path, namespace, "test_own", "TestChild") == "ok"
    assert _check(watch, path, namespace, "test_inherited", "TestChild") == "ok"  # found in its base's def
    assert _check(watch, path, namespace, "test_hidden") == "unchecked"  # a decorator that keeps no __wrapped__
    assert _check(watch, path, namespace, "test_alias") == "unchecked"  # bound by other means than a def
    assert watch.replaced == [] and watch.checked == 5


@pytest.mark.unit
def test_a_swapped_code_or_a_replaced_function_is_replaced(loaded):
    """The forgeries of the issue: ``__code__`` swapped for ``return None`` (compiled under the test
    file's own name, or another test's), the function replaced in its module or its class, a
    wrapper put around an undecorated test."""
    watch, path, namespace = loaded
    quiet: dict = {}
    exec(compile("def _q(*a, **k):\n    return None\n", path, "exec"), quiet)
    plain = namespace["test_plain"].__code__
    namespace["test_plain"].__code__ = quiet["_q"].__code__
    namespace["test_wrapped"].__wrapped__.__code__ = plain  # another test's own code
    namespace["test_other"] = functools.wraps(namespace["test_other"])(lambda *a: None)  # wraps the real one
    namespace["TestChild"].test_own = lambda self: None
    namespace["TestChild"].test_inherited = lambda self: None  # put where its source never put it
    names = ("test_plain", "test_other", "test_wrapped")
    assert [_check(watch, path, namespace, n) for n in names] == ["replaced"] * 3
    assert _check(watch, path, namespace, "test_own", "TestChild") == "replaced"
    assert _check(watch, path, namespace, "test_inherited", "TestChild") == "replaced"
    assert watch.replaced == ["test_plain", "test_other", "test_wrapped", "TestChild.test_own", "TestChild.test_inherited"]


@pytest.mark.unit
def test_a_file_not_read_is_unchecked(tmp_path, loaded):
    watch, path, namespace = loaded
    other = tmp_path.parent / "elsewhere.py"
    assert watch.check("x", namespace["test_plain"], [(str(other), "")], "test_plain") == "unchecked"


AUDIT = '''
import json, sys
sys.path.insert(0, {here!r})
import run_watch
watch = run_watch.Watch({root!r})
watch.read([{test!r}])
watch.start()
namespace = {{}}
exec(compile(open({test!r}).read(), {test!r}, "exec"), namespace)
namespace["test_sets_a_trace_and_takes_it_back"]()  # the test's own code: its business
{package}
watch.check("test_plain", namespace["test_plain"], [({test!r}, "")], "test_plain")
print(json.dumps(watch.report()))
'''
TEST_FILE = '''import sys


def test_plain():
    assert 1 + 1 == 2


def test_sets_a_trace_and_takes_it_back():
    sys.settrace(lambda *a: None)
    sys.settrace(None)
'''


@pytest.mark.parametrize("package,expected", [
    ("", []),
    ("sys.setprofile(lambda *a: None)\nsys.setprofile(None)", ["sys.setprofile", "sys.setprofile"]),
    ("sys.settrace(lambda *a: None)", ["sys.settrace", "a trace hook in place when test_plain was called"]),
    ("namespace['test_plain'].__code__ = (lambda: None).__code__", ["__code__ of test_plain replaced"]),
    ("import threading\nthreading.setprofile(lambda *a: None)", ["a _profile_hook hook in place when test_plain was called"]),
    ("sys.addaudithook(lambda *a: None)", ["sys.addaudithook"]),
])
def test_the_audit_hook_notes_hooks_set_by_anything_but_the_tests(tmp_path, package, expected):
    test = tmp_path / "test_t.py"
    test.write_text(TEST_FILE)
    script = AUDIT.format(here=str(Path(run_watch.__file__).parent), root=str(tmp_path), test=str(test),
                          package=package)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert [h.split(" (", 1)[0] for h in report["hooks"]] == expected, report
