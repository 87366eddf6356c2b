"""Engine integration tests (vLLM, SGLang, LMCache) run in their own virtual environments.

Their pins clash with the project's (vLLM brings its own torch), so the main pytest run does not
collect this folder; `scripts/engines/<engine>.sh` creates (or reuses) the engine's venv and runs
`tests/engines/<engine>` there with ``KVSTRATA_ENGINE_TESTS`` set. `scripts/test.sh` runs them all.
"""

from __future__ import annotations

import os

collect_ignore_glob = [] if os.environ.get("KVSTRATA_ENGINE_TESTS") else ["*"]
