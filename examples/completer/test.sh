#!/bin/sh
# test.sh: run the completer example's tests against a running PostgreSQL server.
#
#   PGHOST=/tmp/sock PGPORT=5432 PGUSER=postgres PGDATABASE=postgres ./test.sh
#
# Needs a superuser connection to a server where the idempotency extension
# (1.8 or later) is installed (shared_preload_libraries = 'idempotency'
# recommended).  Creates a fresh database idem_example_completer, installs the
# npm dependencies from the lock file if node_modules is missing, and runs
# `node --test`.
set -eu
cd "$(dirname "$0")"

DB=${EXAMPLE_DB:-idem_example_completer}
ADMIN_DB=${PGDATABASE:-postgres}

if [ ! -d node_modules ]; then
	npm ci --no-audit --no-fund --loglevel=error
fi

psql -X -q -v ON_ERROR_STOP=1 -d "$ADMIN_DB" \
	-c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" \
	-c "CREATE DATABASE $DB"
PGDATABASE=$DB psql -X -q -v ON_ERROR_STOP=1 -f schema.sql

PGDATABASE=$DB exec node --test --test-concurrency=1 --test-timeout=60000 test/*.test.js
