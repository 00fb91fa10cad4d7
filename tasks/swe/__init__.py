"""The SWE domain: a repository at a commit, a model patch, its tests run so the patch cannot forge them."""
