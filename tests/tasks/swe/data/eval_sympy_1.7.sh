#!/bin/bash
set -uxo pipefail
source /opt/miniconda3/bin/activate
conda activate testbed
cd /testbed
git config --global --add safe.directory /testbed
cd /testbed
git status
git show
git -c core.fileMode=false diff 10ca84ffc56c2dd2d9dc4bd71b7b898e083500cd
source /opt/miniconda3/bin/activate
conda activate testbed
python -m pip install -e .
git checkout 10ca84ffc56c2dd2d9dc4bd71b7b898e083500cd sympy/core/tests/test_basic.py
git apply -v - <<'EOF_114329324912'
diff --git a/sympy/core/tests/test_basic.py b/sympy/core/tests/test_basic.py
--- a/sympy/core/tests/test_basic.py
+++ b/sympy/core/tests/test_basic.py
@@ -1 +1,2 @@
 x
+y

EOF_114329324912
: '>>>>> Start Test Output'
PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' bin/test -C --verbose sympy/core/tests/test_basic.py
: '>>>>> End Test Output'
git checkout 10ca84ffc56c2dd2d9dc4bd71b7b898e083500cd sympy/core/tests/test_basic.py
