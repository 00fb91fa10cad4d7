#!/bin/bash
# Runs in the working directory before the agent; leaves a mark the test looks for.
touch /srv/tool/.setup-ran
