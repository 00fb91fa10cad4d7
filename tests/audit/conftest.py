# tests/audit/weak holds the files of Harbor tasks (a test file for their sandboxes), not tests of ours
collect_ignore_glob = ["weak/*"]
