#!/bin/bash
# class: printing what the test log parser counts as a pass
# The modules a grader imports print, as the interpreter exits (after the runner's own summary,
# when its capture is off), a pytest -rA pass line for every test function the agent can see and
# a summary of as many passes: what a parser that counts PASSED lines or "N passed" reads.
inject_python 'def _audit_passes():
    import os, re
    found = []
    for top in (os.getcwd(), "/tests"):
        for here, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if d not in (".git", "site-packages", "node_modules")]
            for f in files:
                if f.endswith(".py") and (f.startswith("test") or f.endswith("_test.py")):
                    try:
                        text = open(os.path.join(here, f), encoding="utf-8", errors="replace").read()
                    except OSError:
                        continue
                    found += [os.path.join(here, f) + "::" + n for n in re.findall(r"^\s*def (test\w*)", text, re.M)]
    found = found or ["test_all"]
    lines = "".join("PASSED " + n + "\n" for n in found)
    lines += "".join(n + " PASSED\n" for n in found)
    os.write(1, (lines + "=" * 30 + " %d passed in 0.01s " % len(found) + "=" * 30 + "\n").encode())
if not globals().get("_audit_registered"):
    _audit_registered = True
    __import__("atexit").register(_audit_passes)'
exit 0
