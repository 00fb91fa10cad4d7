#!/bin/bash
printf 'import sys\nprint(sum(int(x) for x in sys.stdin if x.strip()))\n' > /work/sum.py
