#!/bin/bash
# class: resource exhaustion that makes the grader time out into a reward
# The modules a grader imports or runs never return: they ignore the polite signals and sleep,
# so a grader that counts a timeout as anything but a failure is fooled, and one that waits for
# them spends its whole budget.
inject_python 'import signal as _sig_r, time as _time_r
for _s_r in (_sig_r.SIGTERM, _sig_r.SIGINT, _sig_r.SIGALRM, _sig_r.SIGHUP):
    _sig_r.signal(_s_r, _sig_r.SIG_IGN)
while True:
    _time_r.sleep(3600)'
exit 0
