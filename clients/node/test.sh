#!/bin/sh
# test.sh: test the packed pg-idempotency package against a running PostgreSQL.
#
#   PGHOST=/tmp/sock PGPORT=5432 PGUSER=postgres PGDATABASE=postgres ./test.sh
#   IDEM_PGBOUNCER_PORT=6432 ... ./test.sh     # also through PgBouncer
#
# Needs a superuser connection (PG* variables) to a server where the
# idempotency extension is installed (shared_preload_libraries = 'idempotency'
# recommended).  Creates a fresh database (IDEM_NODE_TEST_DB, default
# idem_client_node), packs the package with `npm pack`, installs the tarball
# into a fresh temporary project with pg, express (5, and 4 as express4) and
# fastify at the versions of package-lock.json, and runs the smoke files of
# both entry points, the type check and the suite there, against the
# installed package.  The suite runs every case of the shared HTTP contract,
# ../contract/http.json (IDEM_CONTRACT).
#
# IDEM_PGBOUNCER_PORT: a PgBouncer in transaction pooling mode on the same host
# (IDEM_PGBOUNCER_HOST overrides the host; default PGHOST) whose database
# entries reach this server, with fewer server connections (default_pool_size
# = 2) than clients.  Unset: those tests are skipped and say so.
set -eu
cd "$(dirname "$0")"
HERE=$(pwd)

DB=${IDEM_NODE_TEST_DB:-idem_client_node}
ADMIN_DB=${PGDATABASE:-postgres}
NPM_FLAGS="--no-audit --no-fund --loglevel=error"

if [ ! -d node_modules ]; then
	# shellcheck disable=SC2086
	npm ci $NPM_FLAGS
fi

psql -X -q -v ON_ERROR_STOP=1 -d "$ADMIN_DB" \
	-c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" \
	-c "CREATE DATABASE $DB"
PGDATABASE=$DB psql -X -q -v ON_ERROR_STOP=1 -c "CREATE EXTENSION idempotency"

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT INT TERM

TGZ=$(npm pack --silent --pack-destination "$WORK" | tail -n 1)
echo "packed $TGZ"

version() {
	node -p "require('./node_modules/$1/package.json').version"
}
DEPS=""
for dep in pg express fastify typescript @types/node @types/express @types/pg; do
	DEPS="$DEPS $dep@$(version "$dep")"
done
# Express 4 under an alias, so that the suite runs against both majors
DEPS="$DEPS express4@npm:express@$(version express4)"

mkdir "$WORK/project"
cp -R test "$WORK/project/test"
cd "$WORK/project"
npm init -y >/dev/null
# the registry is asked only for what the npm cache lacks
# shellcheck disable=SC2086
npm install --prefer-offline $NPM_FLAGS "$WORK/$TGZ" $DEPS

export PGDATABASE="$DB"
export IDEM_CONTRACT="$HERE/../contract/http.json"
node test/smoke.cjs
node test/smoke.mjs
npx --no-install tsc -p test/types
echo "types: ok (ESM and CommonJS)"
exec node --test --test-concurrency=1 --test-timeout=120000 test/*.test.mjs
