#!/bin/sh
# test.sh: build the pg-idempotency wheel, install it into a fresh virtualenv
# and run its tests against a running PostgreSQL server.
#
#   PGHOST=/tmp/sock PGPORT=5432 PGUSER=postgres PGDATABASE=postgres ./test.sh [pytest args]
#
# Needs a superuser connection (libpq PG* variables) to a server where the
# idempotency extension is installed (preloaded or not), and Debian's
# python3-psycopg, python3-psycopg-pool, python3-pytest, python3-pytest-asyncio,
# python3-fastapi, python3-starlette, python3-httpx, python3-uvicorn,
# python3-setuptools, python3-pip and python3-venv.  Creates a fresh database
# (IDEM_PY_DB, default idem_client_python) with the extension.
#
# IDEM_PGBOUNCER_PORT: when set, a PgBouncer in pool_mode = transaction listens
# on PGHOST at that port (same unix socket directory, or same TCP host),
# forwarding any database (or at least the test database) to this server
# with trust auth for PGUSER; the tests then also run through it.  Unset: those
# tests are skipped, with the reason in the summary.
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
PYTHON=${IDEM_PYTHON:-/usr/bin/python3}
DB=${IDEM_PY_DB:-idem_client_python}
ADMIN_DB=${PGDATABASE:-postgres}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/pg-idempotency-test.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# Build from a copy so that no build products land in the source tree.
mkdir "$WORK/src"
(cd "$HERE" && tar -cf - --exclude=./build --exclude=./dist --exclude='*.egg-info' \
	--exclude=__pycache__ --exclude=.venv --exclude=.mypy_cache --exclude=.pytest_cache .) |
	tar -C "$WORK/src" -xf -
"$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation --no-index \
	--wheel-dir "$WORK/dist" "$WORK/src"
WHEEL=$(ls "$WORK"/dist/pg_idempotency-*.whl)
echo "test.sh: built $(basename "$WHEEL")"

# Debian's psycopg, psycopg-pool, starlette, fastapi, httpx, uvicorn and pytest
# come from the system site-packages; the package itself only from the wheel.
"$PYTHON" -m venv --system-site-packages "$WORK/venv"
"$WORK/venv/bin/python" -m pip install --quiet --no-deps --no-index "$WHEEL"

psql -X -q -v ON_ERROR_STOP=1 -d "$ADMIN_DB" -c "SET client_min_messages = warning" \
	-c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" \
	-c "CREATE DATABASE $DB"
psql -X -q -v ON_ERROR_STOP=1 -d "$DB" -c "CREATE EXTENSION idempotency"

# The tests run from a copy outside the source tree: `import pg_idempotency`
# can only find the installed wheel.
cp -r "$HERE/tests" "$WORK/tests"
cd "$WORK/tests"
"$WORK/venv/bin/python" - <<'EOF'
import pg_idempotency, sys
where = pg_idempotency.__file__
if not where.startswith(sys.prefix):
    sys.exit(f"test.sh: pg_idempotency imported from {where}, not from the venv")
print(f"test.sh: testing {where}")
EOF
# The contract the Node suite runs too, read where it lives in the repository.
IDEM_CONTRACT=${IDEM_CONTRACT:-$HERE/../contract/http.json} PGDATABASE=$DB \
	"$WORK/venv/bin/python" -m pytest -p no:cacheprovider -o asyncio_mode=auto \
	-rs -q "$@" .
