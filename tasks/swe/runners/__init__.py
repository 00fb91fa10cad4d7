"""The test runners of the SWE grader, one per repository family: each swaps the family's own runner for the grader's."""
