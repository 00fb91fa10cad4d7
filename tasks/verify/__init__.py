"""Reward verification for the built-in domains: answers (math, STEM), code tests, SWE test logs."""
