#!/bin/sh
# test.sh: run the queue consumer's tests against a running PostgreSQL server.
#
#   PGHOST=/tmp/sock PGPORT=5432 PGUSER=postgres PGDATABASE=postgres ./test.sh
#
# Needs a superuser connection to a server where the idempotency extension is
# installed, and a python3 with psycopg 3 and psycopg-pool (Debian: apt-get
# install python3-psycopg python3-psycopg-pool).  The consumer uses the
# pg_idempotency package from ../../clients/python/src.  Creates a fresh
# database idem_example_consumer and runs the unittest suites, which start
# consumer and checkout worker processes of their own.
set -eu
cd "$(dirname "$0")"
PYTHONPATH=$(cd ../../clients/python/src && pwd)${PYTHONPATH:+:$PYTHONPATH}
# no __pycache__ in the source tree
PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH PYTHONDONTWRITEBYTECODE

DB=${EXAMPLE_DB:-idem_example_consumer}
ADMIN_DB=${PGDATABASE:-postgres}

PYTHON=
for candidate in ${PYTHON3:-} python3 /usr/bin/python3; do
	if command -v "$candidate" >/dev/null 2>&1 &&
	   "$candidate" -c 'import psycopg, psycopg_pool' >/dev/null 2>&1; then
		PYTHON=$candidate
		break
	fi
done
if [ -z "$PYTHON" ]; then
	echo "test.sh: no python3 with psycopg 3 and psycopg-pool found" \
		"(apt-get install python3-psycopg python3-psycopg-pool)" >&2
	exit 1
fi

psql -X -q -v ON_ERROR_STOP=1 -d "$ADMIN_DB" \
	-c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" \
	-c "CREATE DATABASE $DB"
PGDATABASE=$DB psql -X -q -v ON_ERROR_STOP=1 -f schema.sql

PGDATABASE=$DB exec "$PYTHON" -m unittest -v test_consumer test_checkout
