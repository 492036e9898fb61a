#!/usr/bin/env bash
# Run torchforge's own observability unit tests against forge_obs, with only the imports renamed.
#
#   scripts/torchforge_suite.sh [pytest args]
#
# Exports torchforge's tests/conftest.py and tests/unit_tests/observability/*.py (git show, from a
# torchforge git directory: TORCHFORGE_GIT_DIR, default the fetched mirror; TORCHFORGE_REV, default
# HEAD) into a temporary directory outside this repository, renames two imports -- nothing else --
#   forge.observability -> forge_obs   (imports, submodules and mock.patch targets)
#   forge.env           -> forge_obs.env
# and runs them with this repository's forge_obs. Their tests also import
# forge.controller.actor.ForgeActor (test_utils.py: the base class of an actor it defines), which is
# not observability: a one-line shim in the temporary directory makes it Monarch's Actor.
# Nothing of torchforge is copied into this repository; the temporary directory is removed.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TF=${TORCHFORGE_GIT_DIR:-/work/.mirror/meta-pytorch+torchforge/repo}
REV=${TORCHFORGE_REV:-HEAD}
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python
else PY=python3; fi
if ! git --git-dir "$TF" rev-parse -q --verify "$REV^{commit}" >/dev/null 2>&1; then
  echo "torchforge_suite.sh: no torchforge git directory at $TF (set TORCHFORGE_GIT_DIR)" >&2
  exit 2
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/torchforge_suite.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
OBS=tests/unit_tests/observability
mkdir -p "$WORK/$OBS" "$WORK/shim/forge/controller"
for f in tests/conftest.py $(git --git-dir "$TF" ls-tree --name-only "$REV" "$OBS/" | grep '\.py$'); do
  git --git-dir "$TF" show "$REV:$f" >"$WORK/$f"
done
touch "$WORK/tests/__init__.py" "$WORK/tests/unit_tests/__init__.py"
# the only change to their files: the two imports
find "$WORK/tests" -name '*.py' -exec sed -i -e 's/forge\.observability/forge_obs/g' -e 's/forge\.env\b/forge_obs.env/g' {} +
if grep -rn 'forge\.\|from forge \|import forge$' "$WORK/tests" | grep -v 'forge\.controller\.actor' >/dev/null; then
  echo "torchforge_suite.sh: their tests import more of forge than observability, env and ForgeActor:" >&2
  grep -rn 'forge\.' "$WORK/tests" | grep -v 'forge\.controller\.actor' >&2
fi
# the shim for the non-observability import (test_utils.py's actor base class)
: >"$WORK/shim/forge/__init__.py"
: >"$WORK/shim/forge/controller/__init__.py"
echo "from monarch.actor import Actor as ForgeActor  # noqa: F401  (shim for torchforge's base actor)" \
  >"$WORK/shim/forge/controller/actor.py"
cat >"$WORK/pytest.ini" <<'INI'
[pytest]
addopts = -p no:cacheprovider
pythonpath = .
asyncio_default_fixture_loop_scope = function
INI

cd "$WORK"
export PYTHONPATH="$ROOT/src:$ROOT:$WORK/shim:$WORK${PYTHONPATH:+:$PYTHONPATH}"
export MONARCH_FILE_LOG=${MONARCH_FILE_LOG:-error} HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY=${HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY:-1s}
echo "torchforge $(git --git-dir "$TF" rev-parse --short "$REV"): $OBS with forge.observability -> forge_obs, forge.env -> forge_obs.env"
"$PY" -m pytest -q -rfEs "$OBS" "$@"
