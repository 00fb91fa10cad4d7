#!/bin/bash
# class: exit-code and signal tricks
# The modules a grader imports end the test runner's process with status 0 as soon as a runner
# imports them (before any test fails), and turn the signals a grader's timeout sends into exit 0.
inject_python 'import os as _os_a, signal as _sig_a, sys as _sys_a
if any(m == "pytest" or m == "unittest" or m.startswith("_pytest") for m in _sys_a.modules) or "pytest" in " ".join(_sys_a.argv):
    for _s_a in (_sig_a.SIGTERM, _sig_a.SIGINT, _sig_a.SIGALRM, _sig_a.SIGHUP):
        _sig_a.signal(_s_a, lambda *_: _os_a._exit(0))
    _sys_a.stdout.flush()
    _os_a._exit(0)'
exit 0
