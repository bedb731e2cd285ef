"""Run the test suite; "no tests collected" is a failure, not a silent pass.

pytest exits 5 when it collected nothing: that means the suite is broken
(wrong path, import error filtered away), so we say so and fail.
"""

import subprocess
import sys

NO_TESTS_COLLECTED = 5

code = subprocess.call([sys.executable, "-m", "pytest", "-q", *sys.argv[1:]])
if code == NO_TESTS_COLLECTED:
    print("run_tests: pytest collected no tests; treating that as a failure", file=sys.stderr)
    sys.exit(1)
sys.exit(code)
