/* idempotency--1.2--1.3.sql: update the idempotency extension from 1.2 to 1.3 */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.3'" to load this file. \quit

/*
 * 1.3 changes where the stats view takes its key counts from: a count over
 * the whole table in 1.2, stats_key_counts() now, exact while the table is
 * small and estimated from the planner's statistics above
 * idempotency.stats_exact_limit; a last column, key_counts_exact, says
 * which.  The other columns keep their names, types and order, so the view
 * is replaced in place: its owner, privileges and options stay.  The
 * function answers only a role that may read the view, so revoking SELECT
 * on the view hides the counts however a role asks.  No stored row is
 * touched.
 */
CREATE FUNCTION idempotency.stats_key_counts(
	OUT pending bigint, OUT succeeded bigint, OUT failed bigint,
	OUT exact boolean)
RETURNS record
AS 'MODULE_PATHNAME', 'idem_stats_key_counts'
LANGUAGE C VOLATILE PARALLEL SAFE;

/*
 * CREATE OR REPLACE VIEW resets the view's options; options an
 * administrator set on it (security_barrier, security_invoker) are put
 * back, as its owner and privileges stay.
 */
DO $do$
DECLARE
	options text[];
BEGIN
	SELECT c.reloptions INTO options FROM pg_catalog.pg_class c
	 WHERE c.oid OPERATOR(pg_catalog.=) 'idempotency.stats'::pg_catalog.regclass;
	EXECUTE $view$
CREATE OR REPLACE VIEW idempotency.stats AS
SELECT d.datname AS database,
	   c.claims, c.takeovers, c.replays, c.in_progress, c.mismatches,
	   c.finishes, c.releases, c.expired, c.reset,
	   c.last_sweep_at, c.last_sweep_ms,
	   k.pending, k.succeeded, k.failed, k.exact AS key_counts_exact
  FROM pg_catalog.pg_database d
  LEFT JOIN idempotency.stats_counters() c
	ON c.dbid OPERATOR(pg_catalog.=) d.oid
  LEFT JOIN idempotency.stats_key_counts() k
	ON d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()
 WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()
	OR c.dbid IS NOT NULL
$view$;
	IF options IS NOT NULL THEN
		EXECUTE pg_catalog.format('ALTER VIEW idempotency.stats SET (%s)',
								  pg_catalog.array_to_string(options, ', '));
	END IF;
END
$do$;
